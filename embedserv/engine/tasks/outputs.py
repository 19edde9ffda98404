"""Per-call output assembly on the host: Matryoshka truncation, normalization, wire encoding."""

from __future__ import annotations

import numpy as np

from embedserv.types import Activation

# torch.nn.functional.normalize's default: a zero vector stays zero instead of dividing by zero.
_NORM_EPS = 1e-12


def stack_rows(outputs) -> np.ndarray:
    """[n, width] float32: the sequences' pooled vectors or score logits (engine/ports.py's SequenceOutputs), in
    order."""
    return np.stack([output.row for output in outputs])


def finish_embeddings(rows: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[n, dim] float32 pooled rows -> the vectors the caller asked for (truncate first, then normalize), in a
    new array: `rows` is never changed (the calibration rows of int8 ranges are finished many ways)."""
    out = rows[:, :dimensions] if dimensions is not None else rows
    out = np.array(out, dtype=np.float32, order="C", copy=True)
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.maximum(norms, _NORM_EPS)
    return out


def to_little_endian_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype="<f4").tobytes()


def activate(logits: np.ndarray, activation: Activation | str) -> np.ndarray:
    """[n, labels] float32 logits through sigmoid, softmax (per row), tanh or identity."""
    logits = logits.astype(np.float32, copy=False)
    if activation == Activation.SIGMOID:
        # The tanh form of the logistic function: no overflow for large negative logits.
        return (0.5 * (np.tanh(0.5 * logits) + 1.0)).astype(np.float32)
    if activation == Activation.SOFTMAX:
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    if activation == Activation.TANH:
        return np.tanh(logits)
    if activation == Activation.IDENTITY:
        return logits
    raise ValueError(f"unknown activation {activation!r}; one of {', '.join(a.value for a in Activation)}")


def cosine_to_first(rows: np.ndarray) -> np.ndarray:
    """Cosine similarity of rows[0] (the query) with each later row (the documents)."""
    unit = finish_embeddings(rows, None, normalize=True)
    return unit[1:] @ unit[0]


def rank(scores: np.ndarray, top_n: int | None) -> list[tuple[int, float]]:
    """(index, score) best first; equal scores keep request order. top_n beyond the count keeps all."""
    order = np.argsort(-scores, kind="stable")
    if top_n is not None:
        order = order[:top_n]
    return [(int(i), float(scores[i])) for i in order]
