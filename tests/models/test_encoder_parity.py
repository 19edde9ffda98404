"""Our engine (own BERT, own attention, own pooling) equals sentence-transformers on the same weights.

Small random-weight BERT, RoBERTa and XLM-RoBERTa encoders built from configs in the test, with CLS and
mean pooling, run in-process through SyncEngine; the bundled all-MiniLM-L6-v2 covers real weights for
batch invariance. The oracle is sentence-transformers, float32 on CPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm, cosines
from tests.helpers.models import ARCHS, POOLINGS, reference_token_counts

MAX_SEQ_LENGTH = 128
MIN_COSINE = 0.9999


def _params(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(**kwargs)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_encoder_matches_sentence_transformers(arch, pooling, tiny_encoder, reference, engine_for, texts):
    model_dir = tiny_encoder(arch, pooling, max_seq_length=MAX_SEQ_LENGTH)
    st = reference(model_dir)
    counts = reference_token_counts(st, texts)
    assert max(counts) == MAX_SEQ_LENGTH, "the corpus sample must hold texts longer than max_seq_length"

    result = engine_for(model_dir).embed(texts, _params(truncate=True))

    assert result.embeddings.shape == (len(texts), 64)
    assert result.embeddings.dtype == np.float32
    expected = st.encode(texts, convert_to_numpy=True)
    assert_cosine_at_least(result.embeddings, expected, MIN_COSINE, texts, what=f"{arch}/{pooling}: ")
    assert_unit_norm(result.embeddings)
    assert result.prompt_tokens == sum(counts)


@pytest.mark.parametrize(("arch", "pooling"), [("bert", "cls"), ("xlm-roberta", "mean")])
def test_normalize_false_keeps_the_pooled_vector(arch, pooling, tiny_encoder, reference, engine_for, texts):
    """The tiny models have no Normalize module, so normalize=False must give sentence-transformers' raw values."""
    model_dir = tiny_encoder(arch, pooling, max_seq_length=MAX_SEQ_LENGTH)
    expected = reference(model_dir).encode(texts, convert_to_numpy=True)

    raw = engine_for(model_dir).embed(texts, _params(truncate=True, normalize=False)).embeddings

    assert_cosine_at_least(raw, expected, MIN_COSINE, texts)
    norms, expected_norms = np.linalg.norm(raw, axis=1), np.linalg.norm(expected, axis=1)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-4, err_msg="normalize=False changed the vector's length")


def test_models_saved_by_current_sentence_transformers_load(tiny_encoder, reference, engine_for, texts):
    """Files exactly as sentence-transformers 6 writes them (pooling_mode key, max length in the tokenizer)."""
    model_dir = tiny_encoder("bert", "cls", max_seq_length=MAX_SEQ_LENGTH, st_native_format=True)
    st = reference(model_dir)

    engine = engine_for(model_dir)
    result = engine.embed(texts, _params(truncate=True))

    assert engine.info.pooling == "cls"
    assert engine.info.max_input_tokens == MAX_SEQ_LENGTH
    assert_cosine_at_least(result.embeddings, st.encode(texts, convert_to_numpy=True), MIN_COSINE, texts)
    assert result.prompt_tokens == sum(reference_token_counts(st, texts))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_model_info_reads_sentence_transformers_files(pooling, tiny_encoder, engine_for):
    info = engine_for(tiny_encoder("roberta", pooling, max_seq_length=MAX_SEQ_LENGTH)).info
    assert info.dimension == 64
    assert info.max_input_tokens == MAX_SEQ_LENGTH
    assert info.pooling == pooling
    assert info.is_causal is False


def test_named_prompt_matches_sentence_transformers(tiny_encoder, reference, engine_for, texts):
    prompts = {"query": "query: ", "passage": "passage: "}
    model_dir = tiny_encoder("bert", "mean", max_seq_length=MAX_SEQ_LENGTH, prompts=prompts)
    st = reference(model_dir)
    engine = engine_for(model_dir)
    # sentence-transformers may add prompts of its own (an empty "document"); the saved config is the truth.
    assert set(engine.info.prompt_names) == set(st.prompts)
    assert set(prompts) <= set(st.prompts)

    result = engine.embed(texts, _params(truncate=True, prompt_name="query"))

    expected = st.encode(texts, prompt_name="query", convert_to_numpy=True)
    assert_cosine_at_least(result.embeddings, expected, MIN_COSINE, texts)
    assert result.prompt_tokens == sum(reference_token_counts(st, texts, prompt="query: "))
    plain = engine.embed(texts[:3], _params(truncate=True)).embeddings
    assert np.all(cosines(plain, result.embeddings[:3]) < 0.99999), "prompt_name had no effect"


def test_unknown_prompt_name_lists_the_known_ones(tiny_encoder, engine_for):
    from embedserv.errors import InvalidInput

    model_dir = tiny_encoder("bert", "mean", max_seq_length=MAX_SEQ_LENGTH, prompts={"query": "query: "})
    with pytest.raises(InvalidInput) as err:
        engine_for(model_dir).embed(["hello"], _params(prompt_name="no-such-prompt"))
    assert "no-such-prompt" in str(err.value)
    assert "query" in str(err.value)


def test_too_long_without_truncate_is_refused_with_both_numbers(tiny_encoder, reference, engine_for, texts):
    from embedserv.errors import InvalidInput

    model_dir = tiny_encoder("bert", "cls", max_seq_length=MAX_SEQ_LENGTH)
    long_text = max(texts, key=len)
    st_tokenizer = reference(model_dir).tokenizer
    n_tokens = len(st_tokenizer(long_text, truncation=False)["input_ids"])
    assert n_tokens > MAX_SEQ_LENGTH

    with pytest.raises(InvalidInput) as err:
        engine_for(model_dir).embed(["one", "two", "three", long_text], _params(truncate=False))
    message = str(err.value)
    assert re.search(rf"\b{n_tokens}\b", message), f"token count {n_tokens} not in: {message}"
    assert re.search(rf"\b{MAX_SEQ_LENGTH}\b", message), f"limit {MAX_SEQ_LENGTH} not in: {message}"
    assert re.search(r"\b3\b", message), f"the input's index 3 not in: {message}"


def _pack_around(target: str, others: list[str], position: int) -> list[str]:
    return [*others[:position], target, *others[position:]]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariance_tiny(arch, tiny_encoder, engine_for):
    """One input alone equals the same input packed with 50 others (positions reset per sequence)."""
    engine = engine_for(tiny_encoder(arch, "mean", max_seq_length=MAX_SEQ_LENGTH))
    pool = stdlib_texts(60, seed=7)
    target, others = pool[0], pool[1:51]
    params = _params(truncate=True)

    alone = engine.embed([target], params).embeddings[0]
    for position in (0, 25, 50):
        packed = engine.embed(_pack_around(target, others, position), params).embeddings[position]
        diff = float(np.max(np.abs(packed - alone)))
        assert diff <= 1e-5, f"{arch}: input at position {position} of 51 differs from alone by {diff}"


def test_batch_invariance_bundled_model(bundled_dir, engine_for):
    engine = engine_for(bundled_dir)
    pool = stdlib_texts(60, seed=11)
    target, others = pool[0], pool[1:51]
    params = _params(truncate=True)

    alone = engine.embed([target], params).embeddings[0]
    packed = engine.embed(_pack_around(target, others, 25), params).embeddings[25]
    diff = float(np.max(np.abs(packed - alone)))
    assert diff <= 1e-5, f"input packed with 50 others differs from alone by {diff}"


def test_batch_invariance_across_concurrent_calls(tiny_encoder, engine_for):
    """An input in its own call equals the same call submitted beside 50 other calls the scheduler packs with it."""
    engine = engine_for(tiny_encoder("roberta", "cls", max_seq_length=MAX_SEQ_LENGTH))
    if not hasattr(engine, "embed_concurrently"):
        pytest.skip("SyncEngine has no embed_concurrently")
    pool = stdlib_texts(60, seed=13)
    target, others = pool[0], pool[1:51]
    params = _params(truncate=True)

    alone = engine.embed([target], params).embeddings[0]
    results = engine.embed_concurrently([[t] for t in _pack_around(target, others, 25)], params)

    diff = float(np.max(np.abs(results[25].embeddings[0] - alone)))
    assert diff <= 1e-5, f"input in a call packed with 50 other calls differs from alone by {diff}"
    singles = np.stack([r.embeddings[0] for r in results])
    together = engine.embed(_pack_around(target, others, 25), params).embeddings
    np.testing.assert_allclose(singles, together, atol=1e-5, err_msg="51 calls of one input != one call of 51")


# Compiled flex on CPU takes seconds per model (CPU serves with sdpa): --run-slow; the attention tests compare
# one compiled flex case against naive in the default run.
@pytest.mark.parametrize(
    "arch,backend",
    [("roberta", "naive"), ("bert", "naive")]
    + [pytest.param(a, "flex", marks=pytest.mark.slow) for a in ("roberta", "bert")],
)
def test_other_backends_equal_sdpa(arch, backend, tiny_encoder, engine_for, texts):
    model_dir = tiny_encoder(arch, "mean", max_seq_length=MAX_SEQ_LENGTH)
    params = _params(truncate=True)

    sdpa = engine_for(model_dir, attention_backend="sdpa").embed(texts, params)
    # A small batch budget keeps flex's warm-up to two compiled size classes.
    other = engine_for(model_dir, attention_backend=backend, max_batch_tokens=256)
    result = other.embed(texts, params)

    assert other.info.attention_backend == backend
    assert_cosine_at_least(result.embeddings, sdpa.embeddings, 0.99999, texts, what=f"{backend} vs sdpa: ")
    assert result.prompt_tokens == sdpa.prompt_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_full_position_table(arch, tiny_encoder, reference, engine_for):
    """max_seq_length 512 uses every position the config has (RoBERTa: 514 with the padding offset)."""
    model_dir = tiny_encoder(arch, "mean", max_seq_length=512)
    st = reference(model_dir)
    pool = stdlib_texts(300, seed=0)
    counts = [len(st.tokenizer(t, truncation=False)["input_ids"]) for t in pool]
    texts = [t for t, n in sorted(zip(pool, counts, strict=True), key=lambda p: -p[1])][:6] + pool[:4]
    assert reference_token_counts(st, texts)[0] == 512

    result = engine_for(model_dir).embed(texts, _params(truncate=True))

    assert engine_for(model_dir).info.max_input_tokens == 512
    assert_cosine_at_least(result.embeddings, st.encode(texts, convert_to_numpy=True), MIN_COSINE, texts)
    assert result.prompt_tokens == sum(reference_token_counts(st, texts))


@pytest.mark.slow
def test_bundled_model_in_process_on_two_thousand_texts(bundled_dir, bundled_reference, engine_for):
    texts = stdlib_texts(2000, seed=21)
    result = engine_for(bundled_dir).embed(texts, _params(truncate=True))
    expected = bundled_reference.encode(texts, batch_size=64, convert_to_numpy=True)
    assert_cosine_at_least(result.embeddings, expected, MIN_COSINE, texts)
    assert result.prompt_tokens == sum(reference_token_counts(bundled_reference, texts))
