"""Compact encodings (engine/tasks/quantize.py): the bit and per-dimension encodings give the bytes
sentence-transformers' quantize_embeddings gives; int8 / uint8 are symmetric codes of one scale whose raw integer
dot products keep the floats' order (uint8: centred, codes summing to 0); the model's calibration ranges and
scales are computed once from the built-in texts, per dimensions / normalization."""

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


PER_DIMENSION_PRECISIONS = {Encoding.INT8_PER_DIMENSION: "int8", Encoding.UINT8_PER_DIMENSION: "uint8"}


@pytest.mark.parametrize("encoding", list(PER_DIMENSION_PRECISIONS))
def test_per_dimension_encodings_match_quantize_embeddings(encoding):
    calibration = _vectors(n=200, seed=1)
    # One dimension without spread: quantize_embeddings steps by 1 there instead of dividing by zero.
    calibration[:, 5] = 0.25
    vectors = np.concatenate([_vectors(seed=2), calibration[:20]])
    ranges = quantize.ranges_of(calibration, None, normalize=False)

    precision = PER_DIMENSION_PRECISIONS[encoding]
    got = quantize.encode(vectors, encoding, ranges)
    expected = quantize_embeddings(vectors, precision=precision, ranges=ranges)
    from_calibration = quantize_embeddings(vectors, precision=precision, calibration_embeddings=calibration)

    assert got.dtype == expected.dtype and got.shape == vectors.shape
    assert got.tobytes() == expected.tobytes() == from_calibration.tobytes()
    low, high = (-128, 127) if precision == "int8" else (0, 255)
    assert got.min() == low and got.max() == high, "values beyond the ranges must clip to the end buckets"


def test_float16_is_the_float32_values_cast():
    vectors = _vectors()
    got = quantize.encode(vectors, Encoding.FLOAT16)
    assert got.dtype == np.float16
    assert got.tobytes() == vectors.astype(np.float16).tobytes()
    assert quantize.encode(vectors, Encoding.FLOAT32) is vectors


def test_calibrated_encodings_need_their_ranges_or_scale():
    for encoding in PER_DIMENSION_PRECISIONS:
        with pytest.raises(ValueError, match="calibration ranges"):
            quantize.encode(_vectors(), encoding, scale=0.01)
    for encoding in (Encoding.INT8, Encoding.UINT8):
        with pytest.raises(ValueError, match="calibration scale"):
            quantize.encode(_vectors(), encoding, np.zeros((2, 100)))


def test_int8_is_each_value_over_one_scale_rounded_and_clipped():
    vectors = _vectors()
    scale = 0.5 * float(np.abs(vectors).max()) / 127  # small enough that the largest values clip both ways

    codes = quantize.encode(vectors, Encoding.INT8, scale=scale)

    assert codes.dtype == np.int8 and codes.shape == vectors.shape
    expected = np.clip(np.rint(vectors.astype(np.float64) / scale), -127, 127)
    np.testing.assert_array_equal(codes, expected)
    assert codes.min() == -127 and codes.max() == 127, "clipped symmetrically: -128 never appears"
    np.testing.assert_array_equal(quantize.encode(-vectors, Encoding.INT8, scale=scale), -codes)
    assert np.all(codes[0, ::3] == 0), "zero stays zero: no offset"


def test_uint8_codes_are_the_centred_values_with_sums_of_zero_plus_128():
    vectors = _vectors(n=200, dim=100, seed=3) + 0.05  # a non-zero mean, for the centring to remove
    scale = float(np.abs(quantize.centred(vectors)).max()) / 127

    codes = quantize.encode(vectors, Encoding.UINT8, scale=scale)

    assert codes.dtype == np.uint8 and codes.shape == vectors.shape
    signed = codes.astype(np.int64) - 128
    exact = quantize.centred(vectors) / scale
    assert np.all((signed == np.floor(exact)) | (signed == np.ceil(exact))), "each code is a neighbour of its value"
    assert np.all(signed.sum(axis=1) == 0)
    # Rounding up exactly the largest fractional parts: no code rounded down has a larger fraction than one rounded up.
    fractions = exact - np.floor(exact)
    up = signed > np.floor(exact)
    for row in range(len(vectors)):
        if up[row].any() and (~up[row]).any():
            assert fractions[row][up[row]].min() >= fractions[row][~up[row]].max()
    # So a raw dot product is the centred codes' one plus a constant: the same order for every query.
    raw = codes.astype(np.int64) @ codes.astype(np.int64).T
    np.testing.assert_array_equal(raw, signed @ signed.T + 128 * 128 * vectors.shape[1])


def test_uint8_clips_and_keeps_the_sum_as_close_as_the_clipped_values_allow():
    vectors = _vectors(n=20, seed=4)
    scale = 0.5 * float(np.abs(quantize.centred(vectors)).max()) / 127

    codes = quantize.encode(vectors, Encoding.UINT8, scale=scale).astype(np.int64)

    assert codes.min() >= 1 and codes.max() <= 255 and (codes == 255).any()
    clipped = np.clip(quantize.centred(vectors) / scale, -127, 127)
    np.testing.assert_array_equal((codes - 128).sum(axis=1), np.rint(clipped.sum(axis=1)))


def test_scale_is_the_largest_value_of_the_finished_calibration_vectors_over_127():
    rows = _vectors(n=30, dim=16) * np.linspace(1, 5, 30, dtype=np.float32)[:, None] + 0.1
    raw = quantize.scale_of(rows, None, normalize=False, encoding=Encoding.INT8)
    cut = quantize.scale_of(rows, 4, normalize=True, encoding=Encoding.INT8)
    centred = quantize.scale_of(rows, None, normalize=False, encoding=Encoding.UINT8)

    assert raw == pytest.approx(np.abs(rows).max() / 127, rel=1e-6)
    unit = rows[:, :4] / np.linalg.norm(rows[:, :4], axis=1, keepdims=True)
    assert cut == pytest.approx(np.abs(unit).max() / 127, rel=1e-6)
    assert centred == pytest.approx(np.abs(rows - rows.mean(axis=1, keepdims=True)).max() / 127, rel=1e-6)
    assert raw == float(np.float32(raw)), "exactly what EmbedResponse.encoding_scale (a float) carries"
    assert quantize.scale_of(np.zeros((3, 4), np.float32), None, False, Encoding.INT8) == 1.0


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

    async def embed_floats(self, texts: list[str], params: EmbedParams) -> EmbedResult:
        assert params.normalize is False and params.truncate and not params.chunking
        self.embedded += len(texts)
        await asyncio.sleep(0)
        lengths = np.array([len(t) for t in texts], dtype=np.float32)
        rows = np.stack([np.sin(lengths), np.cos(lengths), lengths / 100, -lengths / 50], axis=1)
        return EmbedResult(embeddings=rows.astype(np.float32), prompt_tokens=0)


def test_calibration_embeds_the_texts_once_for_any_number_of_calls():
    engine, calibration = _FakeEngine(), quantize.Calibration()
    ranged = [EmbedParams(encoding=Encoding.INT8_PER_DIMENSION), EmbedParams(dimensions=2, encoding=Encoding.INT8)]
    scaled = [EmbedParams(encoding=Encoding.INT8), EmbedParams(dimensions=2, encoding=Encoding.UINT8)]

    async def run():
        ranges = [calibration.ranges(engine, p) for p in ranged * 3]
        scales = [calibration.scale(engine, p) for p in scaled * 3]
        return await asyncio.gather(*ranges, *scales)

    results = asyncio.run(run())

    texts = quantize.calibration_texts()
    assert engine.embedded == len(texts)
    rows = asyncio.run(_FakeEngine().embed_floats(texts, EmbedParams(normalize=False, truncate=True))).embeddings
    np.testing.assert_array_equal(results[0], quantize.ranges_of(rows, None, True))
    np.testing.assert_array_equal(results[1], quantize.ranges_of(rows, 2, True))
    assert results[1].shape == (2, 2)
    for i in range(2, 6):
        np.testing.assert_array_equal(results[i], results[i % 2])
    expected_scales = [
        quantize.scale_of(rows, None, True, Encoding.INT8),
        quantize.scale_of(rows, 2, True, Encoding.UINT8),
    ]
    assert expected_scales[0] != expected_scales[1]
    assert results[6:] == expected_scales * 3


def test_ranges_of_leaves_the_calibration_rows_alone():
    """Normalized ranges first must not normalize the cached rows that later unnormalized ranges read."""
    engine, calibration = _FakeEngine(), quantize.Calibration()

    async def run():
        normalized = await calibration.ranges(engine, EmbedParams(encoding=Encoding.INT8_PER_DIMENSION))
        await calibration.scale(engine, EmbedParams(encoding=Encoding.UINT8))
        raw = await calibration.ranges(engine, EmbedParams(normalize=False, encoding=Encoding.INT8_PER_DIMENSION))
        return normalized, raw

    _normalized, raw = asyncio.run(run())

    unnormalized = EmbedParams(normalize=False, truncate=True)
    rows = asyncio.run(_FakeEngine().embed_floats(quantize.calibration_texts(), unnormalized))
    np.testing.assert_array_equal(raw, np.vstack([rows.embeddings.min(axis=0), rows.embeddings.max(axis=0)]))
    assert raw[1, 2] > 1, "the raw third dimension reaches 1.0 and beyond; normalized ones cannot"
