"""Comparisons with messages that point at the worst input."""

from __future__ import annotations

import numpy as np


def cosines(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != reference shape {expected.shape}"
    num = (actual * expected).sum(axis=1)
    den = np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1)
    return num / np.maximum(den, 1e-30)


def assert_cosine_at_least(
    actual: np.ndarray, expected: np.ndarray, minimum: float, texts: list[str] | None = None, what: str = ""
) -> None:
    """Every row of actual has cosine >= minimum with the same row of expected."""
    cos = cosines(actual, expected)
    bad = np.flatnonzero(~(cos >= minimum))
    if bad.size:
        worst = int(bad[np.argmin(cos[bad])])
        sample = ""
        if texts is not None:
            sample = f"; its text ({len(texts[worst])} chars) starts {texts[worst][:80]!r}"
        raise AssertionError(
            f"{what}{bad.size} of {len(cos)} embeddings below cosine {minimum} with the reference; "
            f"worst is input {worst} at {cos[worst]:.7f}{sample}; bad indexes: {bad[:20].tolist()}"
        )


def assert_unit_norm(embeddings: np.ndarray, tol: float = 1e-4) -> None:
    norms = np.linalg.norm(np.asarray(embeddings, dtype=np.float64), axis=1)
    off = np.flatnonzero(np.abs(norms - 1.0) > tol)
    assert off.size == 0, f"{off.size} embeddings not unit norm, e.g. input {off[0]} has norm {norms[off[0]]:.6f}"


def normalized(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)
