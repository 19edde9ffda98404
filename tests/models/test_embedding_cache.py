"""The embedding cache in an engine (--embedding-cache): whatever options two calls use, the second call's
answer with the cache (the first filled it) equals its answer without it, bit for bit; bypass_cache neither
reads nor fills it; concurrent identical calls run the model once; rerank, classify and late chunking go through
it too.

Engines here run one sequence per batch (max_batch_requests 1): a sequence's output then does not depend on
which other sequences shared its batch, so a cached output and a computed one may be compared bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedserv.errors import InvalidInput
from embedserv.types import (
    ChunkSplitter,
    ClassifyParams,
    EmbedOutput,
    EmbedParams,
    Encoding,
    LateChunking,
    RerankParams,
    TruncationDirection,
)
from tests.helpers.jina_models import TASKS, build_jina
from tests.helpers.scorers import build_cross_encoder
from tests.helpers.sparse_models import build_bge_m3

LIMIT = 24
CACHE = 64 * 2**20
PROMPTS = {"query": "search query: ", "doc": "passage: "}
TEXTS = [
    "a cat",
    "The quick brown fox jumps over the lazy dog.",
    (
        "Embeddings map texts to vectors; similar texts get similar vectors, and a cache returns the vectors "
        "of texts it has seen before without running the model again."
    ),
    "late",
    "Rerankers score a query against each document; classifiers give every label a score.",
]
_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_encoder):
    root = tmp_path_factory.mktemp("cache-models")
    return {
        "prompted": tiny_encoder("bert", "mean", max_seq_length=LIMIT, prompts=PROMPTS),
        "bge-m3": build_bge_m3(root, head_format="safetensors"),
        "jina": build_jina(root, "mean", max_seq_length=LIMIT)["published"],
        "cross-encoder": build_cross_encoder(root, "bert", num_labels=1, max_seq_length=LIMIT),
        "classifier": build_cross_encoder(root, "bert", num_labels=3, seed=1, max_seq_length=LIMIT),
    }


def _cached(engine_for, model_dir, size: int = CACHE):
    return engine_for(model_dir, embedding_cache=size, max_batch_requests=1)


def _answer(engine, texts: list[str], params: EmbedParams):
    """Everything a call returns but its timing, as bytes; or the error it raised."""
    try:
        result = engine.embed(texts, params)
    except InvalidInput as exc:
        return ("refused", str(exc))
    parts: list[object] = [result.prompt_tokens]
    if result.embeddings is not None:
        parts += [result.embeddings.dtype.str, result.embeddings.shape, result.embeddings.tobytes()]
    for vector in result.sparse or []:
        parts += [vector.indices.tobytes(), vector.values.tobytes()]
    for vectors in result.multi_vectors or []:
        parts += [vectors.shape, vectors.tobytes()]
    for spans, vectors in result.chunks or []:
        parts += [spans, vectors.dtype.str, vectors.shape, vectors.tobytes()]
    return tuple([*parts, result.encoding_scale])


def _check_cached_equals_computed(engine, first, second) -> None:
    """`second` after `first` filled the cache equals `second` bypassing it; the bypass touches nothing."""
    (texts_a, params_a), (texts_b, params_b) = first, second
    _answer(engine, texts_a, params_a)
    cached = _answer(engine, texts_b, params_b)
    before = engine.embedding_cache_stats()
    computed = _answer(engine, texts_b, dataclasses.replace(params_b, bypass_cache=True))
    assert engine.embedding_cache_stats() == before, "a bypassing call read or filled the cache"
    assert cached == computed, (first, second)


_texts = st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3)
_common = {
    # Mostly true: without it, inputs past the limit are refused (compared too, but they reach no cache).
    "truncate": st.sampled_from([True, True, True, False]),
    "truncation_direction": st.sampled_from(list(TruncationDirection)),
    "dimensions": st.sampled_from([None, 8, 32]),
    "normalize": st.booleans(),
    "encoding": st.sampled_from(list(Encoding)),
}
_late_chunking = st.sampled_from(
    [
        None,
        None,
        LateChunking(splitter=ChunkSplitter.SENTENCES),
        LateChunking(splitter=ChunkSplitter.TOKENS, chunk_tokens=4, overlap_tokens=1),
    ]
)
_prompted_params = st.builds(
    EmbedParams,
    prompt_name=st.sampled_from([None, "query", "doc"]),
    chunking=st.booleans(),
    late_chunking=_late_chunking,
    **_common,
)


@_SETTINGS
@given(st.tuples(_texts, _prompted_params), st.tuples(_texts, _prompted_params))
def test_prompts_truncation_chunking_and_encodings(models, engine_for, first, second):
    _check_cached_equals_computed(_cached(engine_for, models["prompted"]), first, second)


_outputs = st.lists(st.sampled_from(list(EmbedOutput)), min_size=1, max_size=3, unique=True).map(tuple)
_bge_params = st.builds(EmbedParams, outputs=_outputs, sparse_top_k=st.sampled_from([None, 3]), **_common)


@_SETTINGS
@given(st.tuples(_texts, _bge_params), st.tuples(_texts, _bge_params))
def test_dense_sparse_and_multi_vector_outputs(models, engine_for, first, second):
    _check_cached_equals_computed(_cached(engine_for, models["bge-m3"]), first, second)


_jina_params = st.builds(EmbedParams, task=st.sampled_from([None, *TASKS]), **_common)


@settings(_SETTINGS, max_examples=25)
@given(st.tuples(_texts, _jina_params), st.tuples(_texts, _jina_params))
def test_task_adapters(models, engine_for, first, second):
    _check_cached_equals_computed(_cached(engine_for, models["jina"]), first, second)


def test_the_property_tests_hit_the_cache(models, engine_for):
    """Run after them (file order): the caches they filled answered some of their sequences."""
    for name in ("prompted", "bge-m3", "jina"):
        stats = _cached(engine_for, models[name]).embedding_cache_stats()
        assert stats.hits > 0 and stats.misses > 0 and stats.entries > 0, (name, stats)


def test_a_hit_is_bit_identical_and_takes_no_inference_time(models, engine_for):
    # Its own cache (another size makes another engine), so that these texts start as misses.
    engine = _cached(engine_for, models["bge-m3"], size=CACHE - 1)
    params = EmbedParams(outputs=tuple(EmbedOutput))
    texts = ["only in this test", "and this one too"]
    miss = engine.embed(texts, params)
    before = engine.embedding_cache_stats()
    hit = engine.embed(texts, params)
    after = engine.embedding_cache_stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 0)
    assert hit.embeddings.tobytes() == miss.embeddings.tobytes()
    for a, b in zip(hit.sparse, miss.sparse, strict=True):
        assert a.indices.tobytes() == b.indices.tobytes() and a.values.tobytes() == b.values.tobytes()
    for a, b in zip(hit.multi_vectors, miss.multi_vectors, strict=True):
        assert a.tobytes() == b.tobytes()
    assert hit.timing.queue_us == 0 and hit.timing.inference_us == 0 and hit.timing.total_us >= 0
    assert hit.prompt_tokens == miss.prompt_tokens


def test_bypass_neither_reads_nor_fills(models, engine_for):
    engine = _cached(engine_for, models["prompted"], size=CACHE - 2)
    bypass = EmbedParams(bypass_cache=True)
    engine.embed(["seen with bypass only"], bypass)
    assert engine.embedding_cache_stats().entries == 0
    engine.embed(["seen with bypass only"], EmbedParams())
    stats = engine.embedding_cache_stats()
    assert (stats.hits, stats.misses, stats.entries) == (0, 1, 1)
    engine.embed(["seen with bypass only"], bypass)
    assert engine.embedding_cache_stats() == stats


def _count_sequences(engine) -> list[int]:
    """Counts the sequences the engine's workers run from now on (one entry per batch)."""
    prefill = engine.core.prefill
    counted: list[int] = []
    step_done = prefill.step_done

    async def counting(step, *args):
        counted.append(step.batch.num_sequences)
        return await step_done(step, *args)

    prefill.step_done = counting
    return counted


@pytest.mark.parametrize("bypass", [False, True])
def test_concurrent_identical_calls_run_the_model_once(models, engine_for, bypass):
    engine = engine_for(models["prompted"], embedding_cache=CACHE, max_batch_requests=2, pipeline_depth=1)
    texts = [f"concurrent {bypass} {i}" for i in range(3)]
    counted = _count_sequences(engine)
    results = engine.embed_concurrently([texts] * 8, EmbedParams(bypass_cache=bypass))
    assert sum(counted) == (8 * 3 if bypass else 3)
    assert all(r.embeddings.tobytes() == results[0].embeddings.tobytes() for r in results)


def test_rerank_goes_through_the_cache(models, engine_for):
    engine = _cached(engine_for, models["cross-encoder"])
    plain = engine_for(models["cross-encoder"], max_batch_requests=1)
    assert plain.embedding_cache_stats() is None
    documents = TEXTS[1:]
    for query in ("a cat", "vectors", "a cat"):
        cached = engine.rerank(query, documents, RerankParams(truncate=True))
        computed = plain.rerank(query, documents, RerankParams(truncate=True))
        assert [(r.index, r.score) for r in cached.results] == [(r.index, r.score) for r in computed.results]
    raw = engine.rerank("a cat", documents, RerankParams(truncate=True, raw_scores=True))
    assert raw.results != cached.results  # the activation runs after the cache, on every call
    stats = engine.embedding_cache_stats()
    assert stats.hits == 2 * len(documents) and stats.misses == 2 * len(documents)


def test_classify_goes_through_the_cache(models, engine_for):
    engine = _cached(engine_for, models["classifier"])
    plain = engine_for(models["classifier"], max_batch_requests=1)
    for params in (ClassifyParams(truncate=True), ClassifyParams(truncate=True, raw_scores=True)):
        cached = engine.classify(TEXTS, params)
        np.testing.assert_array_equal(cached.scores, plain.classify(TEXTS, params).scores)
    assert engine.embedding_cache_stats().hits == len(TEXTS)
