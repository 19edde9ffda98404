"""Per-call output assembly on the host: Matryoshka truncation, normalization, wire encoding."""

from __future__ import annotations

import numpy as np

# torch.nn.functional.normalize's default: a zero vector stays zero instead of dividing by zero.
_NORM_EPS = 1e-12


def finish_embeddings(rows: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[n, dim] float32 pooled rows -> the vectors the caller asked for (truncate first, then normalize)."""
    out = rows[:, :dimensions] if dimensions is not None else rows
    out = np.ascontiguousarray(out, dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.maximum(norms, _NORM_EPS)
    return out


def to_little_endian_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, dtype="<f4").tobytes()
