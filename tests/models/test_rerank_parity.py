"""Rerank equals the reference libraries on the same weights (float32, absolute error <= 1e-4).

- Cross-encoders (BERT, RoBERTa, XLM-R ForSequenceClassification, random weights): sentence-transformers
  CrossEncoder.predict, long documents truncated, order and top_n.
- Decoder classifiers (Llama/Qwen2/Qwen3ForSequenceClassification): transformers' own last-non-pad score.
- A Qwen3-Reranker-style causal LM: the model card's yes/no computation with transformers.
- Embedding models: sentence-transformers cosine similarity of encode_query / encode_document.
"""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import util

from benchmarks.corpus import stdlib_texts
from embedserv.engine.inputs import pairs
from tests.helpers.scorers import (
    CROSS_ENCODER_ARCHS,
    build_cross_encoder,
    build_decoder_classifier,
    build_decoder_reranker,
    classifier_reference,
    qwen3_reranker_reference,
    qwen3_reranker_reference_logits,
)

ATOL = 1e-4
MAX_SEQ_LENGTH = 128


def _params(**kwargs):
    from embedserv.types import RerankParams

    return RerankParams(**kwargs)


def _scores_in_request_order(result, count: int) -> np.ndarray:
    scores = np.full(count, np.nan, dtype=np.float32)
    for ranked in result.results:
        scores[ranked.index] = ranked.score
    return scores


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """30 real documents; several are longer than the tiny models' 128-token limit."""
    return stdlib_texts(30, seed=7)


@pytest.fixture(scope="module")
def queries() -> list[str]:
    """Short queries (well under half the limit, so CrossEncoder's longest_first truncation cuts only the
    document, which is what we always do)."""
    return [" ".join(t.split()[:n]) for t, n in zip(stdlib_texts(3, seed=11), (3, 8, 14), strict=True)]


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("scorers")
    cache: dict[tuple, object] = {}

    def build(kind: str, *args, **kwargs):
        key = (kind, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            builder = {
                "cross": build_cross_encoder,
                "decoder_cls": build_decoder_classifier,
                "reranker": build_decoder_reranker,
            }[kind]
            cache[key] = builder(root, *args, **kwargs)
        return cache[key]

    return build


@pytest.mark.parametrize("arch", CROSS_ENCODER_ARCHS)
def test_cross_encoder_matches_sentence_transformers(arch, scorer_dir, engine_for, queries, documents):
    from sentence_transformers import CrossEncoder

    model_dir = scorer_dir("cross", arch, max_seq_length=MAX_SEQ_LENGTH)
    reference = CrossEncoder(str(model_dir), device="cpu")
    engine = engine_for(model_dir)
    lengths = [len(reference.tokenizer(q, d)["input_ids"]) for q in queries for d in documents]
    assert max(lengths) > MAX_SEQ_LENGTH, "some pairs must need truncation"

    for query in queries:
        expected = reference.predict([(query, d) for d in documents])
        result = engine.rerank(query, documents, _params(truncate=True))

        got = _scores_in_request_order(result, len(documents))
        np.testing.assert_allclose(got, expected, atol=ATOL, err_msg=f"{arch}: query {query!r}")
        assert [r.index for r in result.results] == list(np.argsort(-expected, kind="stable"))
        assert expected.std() > 0.02, "scores must spread for the order check to mean something"


def test_cross_encoder_top_n_and_raw_scores(scorer_dir, engine_for, queries, documents):
    from sentence_transformers import CrossEncoder

    model_dir = scorer_dir("cross", "bert", max_seq_length=MAX_SEQ_LENGTH)
    reference = CrossEncoder(str(model_dir), device="cpu")
    engine = engine_for(model_dir)
    pairs = [(queries[1], d) for d in documents]
    logits = reference.predict(pairs, activation_fn=lambda x: x)

    top = engine.rerank(queries[1], documents, _params(truncate=True, top_n=5))
    raw = engine.rerank(queries[1], documents, _params(truncate=True, raw_scores=True))
    everything = engine.rerank(queries[1], documents[:3], _params(truncate=True, top_n=10))

    assert [r.index for r in top.results] == list(np.argsort(-logits, kind="stable")[:5])
    np.testing.assert_allclose(_scores_in_request_order(raw, len(documents)), logits, atol=ATOL)
    assert len(everything.results) == 3


@pytest.mark.parametrize("activation", ["identity", "tanh"])
def test_cross_encoder_activation_from_its_config(activation, scorer_dir, engine_for, queries, documents):
    from sentence_transformers import CrossEncoder

    model_dir = scorer_dir("cross", "xlm-roberta", max_seq_length=MAX_SEQ_LENGTH, activation=activation)
    expected = CrossEncoder(str(model_dir), device="cpu").predict([(queries[0], d) for d in documents])

    got = _scores_in_request_order(engine_for(model_dir).rerank(queries[0], documents, _params(truncate=True)), 30)

    np.testing.assert_allclose(got, expected, atol=ATOL)
    if activation == "identity":
        assert (got < 0).any() or (got > 1).any(), "identity must not squash scores into (0, 1)"


def test_documents_split_over_many_batches_score_the_same(scorer_dir, engine_for, queries, documents):
    model_dir = scorer_dir("cross", "bert", max_seq_length=MAX_SEQ_LENGTH)
    whole = engine_for(model_dir).rerank(queries[2], documents, _params(truncate=True))
    split = engine_for(model_dir, max_batch_tokens=256).rerank(queries[2], documents, _params(truncate=True))

    np.testing.assert_allclose(_scores_in_request_order(split, 30), _scores_in_request_order(whole, 30), atol=1e-5)


def test_cross_encoder_refuses_what_does_not_fit(scorer_dir, engine_for, queries, documents):
    from embedserv.errors import InvalidInput

    engine = engine_for(scorer_dir("cross", "bert", max_seq_length=MAX_SEQ_LENGTH))
    long_document = max(documents, key=len)
    with pytest.raises(InvalidInput, match="document 1 has .* tokens, more than the model's limit of 128"):
        engine.rerank(queries[0], ["short", long_document], _params())
    with pytest.raises(InvalidInput, match="the query has .* tokens, which leaves no room for a document"):
        engine.rerank(long_document, ["short"], _params(truncate=True))
    with pytest.raises(InvalidInput, match="takes no instruction"):
        engine.rerank(queries[0], ["short"], _params(instruction="Find passages about cats"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_classifier_rerank_matches_transformers(arch, scorer_dir, engine_for, documents):
    model_dir = scorer_dir("decoder_cls", arch, max_seq_length=MAX_SEQ_LENGTH)
    query = "read a gzip file"
    expected = _sigmoid(classifier_reference(model_dir, None, pairs=[(query, d) for d in documents])[:, 0])

    result = engine_for(model_dir).rerank(query, documents, _params(truncate=True))

    np.testing.assert_allclose(_scores_in_request_order(result, len(documents)), expected, atol=ATOL)


def test_decoder_classifier_skips_trailing_padding_like_transformers(scorer_dir, engine_for, documents):
    """With [SEP] as the pad token, transformers scores the token before the closing [SEP]."""
    model_dir = scorer_dir("decoder_cls", "qwen3", max_seq_length=MAX_SEQ_LENGTH, pad_token_id=102)
    query = "read a gzip file"
    expected = _sigmoid(classifier_reference(model_dir, None, pairs=[(query, d) for d in documents])[:, 0])

    result = engine_for(model_dir).rerank(query, documents, _params(truncate=True))

    np.testing.assert_allclose(_scores_in_request_order(result, len(documents)), expected, atol=ATOL)


@pytest.mark.parametrize("tied", [False, True])
def test_yes_no_reranker_matches_the_model_card(tied, scorer_dir, engine_for, documents):
    model_dir = scorer_dir("reranker", seed=3, tie_word_embeddings=tied)
    engine = engine_for(model_dir)
    assert engine.info.tasks == (engine.info.tasks[0],) and engine.info.tasks[0].value == "rerank"
    query = "how do I check whether a file is a zip archive"
    expected = qwen3_reranker_reference(model_dir, query, documents)
    served = engine.engine.served
    template = served.task.template
    lengths = [
        len(pairs.encode_templated(served.tokenizer, template, template.default_instruction, query, [d], True)[0].ids)
        for d in documents
    ]
    assert max(lengths) == 256, "some prompts must be cut at the model's limit"

    result = engine.rerank(query, documents, _params(truncate=True))
    raw = engine.rerank(query, documents, _params(truncate=True, raw_scores=True))

    np.testing.assert_allclose(_scores_in_request_order(result, len(documents)), expected, atol=ATOL)
    np.testing.assert_allclose(
        _scores_in_request_order(raw, len(documents)),
        qwen3_reranker_reference_logits(model_dir, query, documents),
        atol=ATOL,
    )
    assert expected.std() > 0.01


def test_yes_no_reranker_instruction(scorer_dir, engine_for, documents):
    model_dir = scorer_dir("reranker", seed=3)
    instruction = "Given a Python question, find the docstring that answers it"
    query = "gzip"
    expected = qwen3_reranker_reference(model_dir, query, documents[:8], instruction=instruction)
    default = qwen3_reranker_reference(model_dir, query, documents[:8])

    result = engine_for(model_dir).rerank(query, documents[:8], _params(truncate=True, instruction=instruction))

    got = _scores_in_request_order(result, 8)
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert np.abs(got - default).max() > 1e-3, "the instruction must change the scores"


def test_bi_encoder_rerank_is_sentence_transformers_cosine(bundled_dir, bundled_reference, engine_for, documents):
    query = "Check whether a file is a ZIP file"
    expected = util.cos_sim(
        bundled_reference.encode_query(query, convert_to_tensor=True),
        bundled_reference.encode_document(documents, convert_to_tensor=True),
    )[0].numpy()

    result = engine_for(bundled_dir).rerank(query, documents, _params(truncate=True, top_n=4))

    assert [r.index for r in result.results] == list(np.argsort(-expected, kind="stable")[:4])
    np.testing.assert_allclose([r.score for r in result.results], np.sort(expected)[::-1][:4], atol=ATOL)


def test_bi_encoder_rerank_uses_query_and_document_prompts(tiny_encoder, reference, engine_for, documents):
    prompts = {"query": "query: ", "document": "passage: "}
    model_dir = tiny_encoder("bert", "mean", prompts=prompts)
    st = reference(model_dir)
    query = "Check whether a file is a ZIP file"
    expected = util.cos_sim(
        st.encode_query(query, convert_to_tensor=True), st.encode_document(documents, convert_to_tensor=True)
    )[0].numpy()

    result = engine_for(model_dir).rerank(query, documents, _params(truncate=True))

    np.testing.assert_allclose(_scores_in_request_order(result, len(documents)), expected, atol=ATOL)


@pytest.mark.parametrize("kind", ["cross", "reranker"])
def test_bfloat16_scores_stay_close_to_float32(kind, scorer_dir, engine_for, documents):
    """The score head runs in float32 on bfloat16 hidden states; scores move by rounding only."""
    model_dir = (
        scorer_dir("cross", "bert", max_seq_length=MAX_SEQ_LENGTH)
        if kind == "cross"
        else scorer_dir("reranker", seed=3)
    )
    query = "read a gzip file"
    exact = engine_for(model_dir).rerank(query, documents, _params(truncate=True))
    rounded = engine_for(model_dir, dtype="bfloat16").rerank(query, documents, _params(truncate=True))

    np.testing.assert_allclose(
        _scores_in_request_order(rounded, len(documents)), _scores_in_request_order(exact, len(documents)), atol=0.03
    )
