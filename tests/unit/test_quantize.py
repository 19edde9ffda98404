"""Compact encodings (engine/tasks/quantize.py) give the bytes sentence-transformers' quantize_embeddings gives, and
the model's calibration ranges are computed once from the built-in texts, per dimensions / normalization."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from sentence_transformers import quantize_embeddings

from embedserv.engine.tasks import quantize
from embedserv.types import EmbedParams, EmbedResult, Encoding


def _vectors(n: int = 50, dim: int = 100, seed: int = 0) -> np.ndarray:
    """Normalized float32 vectors with exact zeros and values outside any small calibration set's range."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors[0, ::3] = 0.0
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


@pytest.mark.parametrize("dim", [100, 64, 3])
@pytest.mark.parametrize("encoding", [Encoding.BINARY, Encoding.UBINARY])
def test_bit_encodings_match_quantize_embeddings(encoding, dim):
    vectors = _vectors(dim=dim)
    got = quantize.encode(vectors, encoding)
    expected = quantize_embeddings(vectors, precision=encoding.value)

    assert got.dtype == expected.dtype == (np.int8 if encoding is Encoding.BINARY else np.uint8)
    assert got.shape == (len(vectors), -(-dim // 8))
    assert got.tobytes() == expected.tobytes()


def test_binary_packs_the_sign_most_significant_bit_first():
    vector = np.array([[1, -1, 0, 2, -3, 0.5, 0, 0, -1, 1]], dtype=np.float32)
    assert quantize.encode(vector, Encoding.UBINARY).tolist() == [[0b10010100, 0b01000000]]
    assert quantize.encode(vector, Encoding.BINARY).tolist() == [[0b10010100 - 128, 0b01000000 - 128]]


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.UINT8])
def test_ranged_encodings_match_quantize_embeddings(encoding):
    calibration = _vectors(n=200, seed=1)
    # One dimension without spread: quantize_embeddings steps by 1 there instead of dividing by zero.
    calibration[:, 5] = 0.25
    vectors = np.concatenate([_vectors(seed=2), calibration[:20]])
    ranges = quantize.ranges_of(calibration, None, normalize=False)

    got = quantize.encode(vectors, encoding, ranges)
    expected = quantize_embeddings(vectors, precision=encoding.value, ranges=ranges)
    from_calibration = quantize_embeddings(vectors, precision=encoding.value, calibration_embeddings=calibration)

    assert got.dtype == expected.dtype and got.shape == vectors.shape
    assert got.tobytes() == expected.tobytes() == from_calibration.tobytes()
    low, high = (-128, 127) if encoding is Encoding.INT8 else (0, 255)
    assert got.min() == low and got.max() == high, "values beyond the ranges must clip to the end buckets"


def test_float16_is_the_float32_values_cast():
    vectors = _vectors()
    got = quantize.encode(vectors, Encoding.FLOAT16)
    assert got.dtype == np.float16
    assert got.tobytes() == vectors.astype(np.float16).tobytes()
    assert quantize.encode(vectors, Encoding.FLOAT32) is vectors


def test_ranged_encodings_need_ranges():
    with pytest.raises(ValueError, match="calibration ranges"):
        quantize.encode(_vectors(), Encoding.INT8)


def test_ranges_follow_the_requests_dimensions_and_normalization():
    rows = _vectors(n=30, dim=16) * np.linspace(1, 5, 30, dtype=np.float32)[:, None]
    raw = quantize.ranges_of(rows, None, normalize=False)
    cut = quantize.ranges_of(rows, 4, normalize=True)

    np.testing.assert_array_equal(raw, np.vstack([rows.min(axis=0), rows.max(axis=0)]))
    unit = rows[:, :4] / np.linalg.norm(rows[:, :4], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, np.vstack([unit.min(axis=0), unit.max(axis=0)]), rtol=1e-6)
    assert raw.dtype == cut.dtype == np.float32


def test_calibration_texts_are_the_files_lines_after_its_header():
    lines = quantize.CALIBRATION_FILE.read_text(encoding="utf-8").splitlines()
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    texts = quantize.calibration_texts()
    assert texts == lines[header:] and len(texts) >= 200
    assert not any(t.startswith("#") or not t.strip() for t in texts)


class _FakeEngine:
    """Embeds a text as a vector derived from its length; counts the texts it embedded."""

    def __init__(self) -> None:
        self.embedded = 0

    async def embed(self, texts: list[str], params: EmbedParams) -> EmbedResult:
        assert params.normalize is False and params.truncate and not params.chunking
        self.embedded += len(texts)
        await asyncio.sleep(0)
        lengths = np.array([len(t) for t in texts], dtype=np.float32)
        rows = np.stack([np.sin(lengths), np.cos(lengths), lengths / 100, -lengths / 50], axis=1)
        return EmbedResult(embeddings=rows.astype(np.float32), prompt_tokens=0)


def test_calibration_embeds_the_texts_once_for_any_number_of_calls():
    engine, calibration = _FakeEngine(), quantize.Calibration()

    async def run():
        params = [EmbedParams(encoding=Encoding.INT8), EmbedParams(dimensions=2, encoding=Encoding.UINT8)]
        return await asyncio.gather(*(calibration.ranges(engine, p) for p in params * 3))

    results = asyncio.run(run())

    texts = quantize.calibration_texts()
    assert engine.embedded == len(texts)
    rows = asyncio.run(_FakeEngine().embed(texts, EmbedParams(normalize=False, truncate=True))).embeddings
    np.testing.assert_array_equal(results[0], quantize.ranges_of(rows, None, True))
    np.testing.assert_array_equal(results[1], quantize.ranges_of(rows, 2, True))
    assert results[1].shape == (2, 2)
    for i in range(2, 6):
        np.testing.assert_array_equal(results[i], results[i % 2])


def test_ranges_of_leaves_the_calibration_rows_alone():
    """Normalized ranges first must not normalize the cached rows that later unnormalized ranges read."""
    engine, calibration = _FakeEngine(), quantize.Calibration()

    async def run():
        normalized = await calibration.ranges(engine, EmbedParams(encoding=Encoding.INT8))
        raw = await calibration.ranges(engine, EmbedParams(normalize=False, encoding=Encoding.INT8))
        return normalized, raw

    normalized, raw = asyncio.run(run())

    rows = asyncio.run(_FakeEngine().embed(quantize.calibration_texts(), EmbedParams(normalize=False, truncate=True)))
    np.testing.assert_array_equal(raw, np.vstack([rows.embeddings.min(axis=0), rows.embeddings.max(axis=0)]))
    assert raw[1, 2] > 1, "the raw third dimension reaches 1.0 and beyond; normalized ones cannot"
