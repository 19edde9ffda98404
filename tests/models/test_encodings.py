"""Compact encodings through the engine: the bytes sentence-transformers' quantize_embeddings gives for the
engine's float32 vectors, the same bytes for a text whatever else its batch holds, and retrieval close to
float32's on real texts (benchmarks/encoding_retrieval.py prints the full table).

int8 / uint8 are checked against ranges computed here from the engine's float32 vectors of the built-in
calibration texts, embedded with the call's dimensions and normalization.
"""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import quantize_embeddings

from benchmarks.corpus import stdlib_texts
from benchmarks.encoding_retrieval import overlap_at_k, recall_at_k, retrieval_set, scores, top_k
from embedserv.engine.tasks.quantize import calibration_texts
from embedserv.types import EmbedParams, Encoding

BITS = (Encoding.BINARY, Encoding.UBINARY)
RANGED = (Encoding.INT8, Encoding.UINT8)


def _calibration_ranges(engine, **params) -> np.ndarray:
    vectors = engine.embed(calibration_texts(), EmbedParams(truncate=True, **params)).embeddings
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)])


@pytest.fixture(scope="module")
def tiny(tiny_encoder, engine_for):
    """A random-weight BERT taking 32 tokens, so calibrating it is quick."""
    return engine_for(tiny_encoder("bert", "mean", max_seq_length=32))


@pytest.fixture(scope="module")
def minilm_ranges(minilm) -> np.ndarray:
    return _calibration_ranges(minilm)


@pytest.fixture(scope="module")
def some_texts(texts) -> list[str]:
    return texts[:16]


@pytest.fixture(scope="module")
def minilm(bundled_dir, engine_for):
    return engine_for(bundled_dir)


@pytest.mark.parametrize("dimensions", [None, 20])
def test_float16_and_bits_match_quantize_embeddings(dimensions, tiny, some_texts):
    texts = some_texts
    floats = tiny.embed(texts, EmbedParams(truncate=True, dimensions=dimensions)).embeddings
    half = tiny.embed(texts, EmbedParams(truncate=True, dimensions=dimensions, encoding=Encoding.FLOAT16))

    assert half.embeddings.dtype == np.float16 and half.embeddings.tobytes() == floats.astype(np.float16).tobytes()
    for encoding in BITS:
        got = tiny.embed(texts, EmbedParams(truncate=True, dimensions=dimensions, encoding=encoding)).embeddings
        expected = quantize_embeddings(floats, precision=encoding.value)
        assert got.dtype == expected.dtype and got.shape == (len(texts), -(-floats.shape[1] // 8))
        assert got.tobytes() == expected.tobytes(), encoding


@pytest.mark.parametrize(
    ("dimensions", "normalize"), [(None, True), pytest.param(24, False, marks=pytest.mark.slow)]
)
def test_int8_and_uint8_match_quantize_embeddings_with_the_calibration_ranges(dimensions, normalize, tiny, texts):
    params = dict(dimensions=dimensions, normalize=normalize)
    floats = tiny.embed(texts, EmbedParams(truncate=True, **params)).embeddings
    ranges = _calibration_ranges(tiny, **params)

    for encoding in RANGED:
        got = tiny.embed(texts, EmbedParams(truncate=True, encoding=encoding, **params)).embeddings
        expected = quantize_embeddings(floats, precision=encoding.value, ranges=ranges)
        assert got.dtype == expected.dtype and got.shape == floats.shape
        assert got.tobytes() == expected.tobytes(), encoding
        # Buckets spread over the range; a batch of its own would give a different scale.
        assert len(np.unique(got)) > 100


def _same_bytes_alone_and_in_batches(engine, encodings) -> None:
    """Three texts alone, then inside concurrent calls of other sizes, mixes and orders."""
    texts = stdlib_texts(10, seed=4)
    for encoding in encodings:
        params = EmbedParams(truncate=True, encoding=encoding)
        alone = [engine.embed([text], params).embeddings[0].tobytes() for text in texts[:3]]
        calls = [texts[:3] + texts[5:], texts[1:3], [texts[2], texts[0], texts[4], texts[1]]]
        batches = [[v.tobytes() for v in result.embeddings] for result in engine.embed_concurrently(calls, params)]
        assert batches[0][:3] == alone and batches[1] == alone[1:], encoding
        assert [batches[2][i] for i in (1, 3, 0)] == alone, encoding


def test_a_text_gets_the_same_bytes_alone_or_in_any_batch(minilm):
    _same_bytes_alone_and_in_batches(minilm, (Encoding.FLOAT32, Encoding.FLOAT16, *BITS))


@pytest.mark.slow
def test_minilm_int8_bytes_match_and_do_not_depend_on_the_batch(minilm, minilm_ranges, texts):
    floats = minilm.embed(texts, EmbedParams(truncate=True)).embeddings
    ranges = minilm_ranges
    for encoding in RANGED:
        got = minilm.embed(texts, EmbedParams(truncate=True, encoding=encoding)).embeddings
        assert got.tobytes() == quantize_embeddings(floats, precision=encoding.value, ranges=ranges).tobytes()
    _same_bytes_alone_and_in_batches(minilm, RANGED)


@pytest.mark.slow
def test_minilm_retrieval_in_compact_encodings_stays_close_to_float(minilm, minilm_ranges):
    """300 stdlib docstring bodies, 60 of their first lines as queries (benchmarks/encoding_retrieval.py). Measured:
    int8 overlap@10 0.98 dequantized, 0.82 as raw integer dot products; binary 0.69 (hamming), 0.79 with
    float queries; float32 recall@10 0.85."""
    documents, queries = retrieval_set(300, 60)
    embedded = {}
    for encoding in (Encoding.FLOAT32, Encoding.INT8, Encoding.BINARY):
        params = EmbedParams(truncate=True, encoding=encoding)
        embedded[encoding] = [minilm.embed(texts, params).embeddings for texts in (queries, documents)]
    ranges = minilm_ranges
    reference = top_k(scores(*embedded[Encoding.FLOAT32], Encoding.FLOAT32, "dot"))

    def overlap(encoding, scoring):
        top = top_k(scores(*embedded[encoding], encoding, scoring, ranges, embedded[Encoding.FLOAT32][0]))
        return overlap_at_k(top, reference), recall_at_k(top)

    float_recall = recall_at_k(reference)
    assert float_recall >= 0.75, "the queries must find their documents for the comparison to mean something"
    # uint8 holds the same buckets as int8 (shifted by 128): the same ranking once dequantized.
    int8_overlap, int8_recall = overlap(Encoding.INT8, "dequantized")
    assert int8_overlap >= 0.9 and int8_recall >= float_recall - 0.05, (int8_overlap, int8_recall)
    assert overlap(Encoding.INT8, "int dot")[0] >= 0.7
    assert overlap(Encoding.BINARY, "float query")[0] >= 0.6
    assert overlap(Encoding.BINARY, "hamming")[0] >= 0.5
