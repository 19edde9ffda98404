"""Encoder-decoder models on the prefill-only path (no KV cache): monoT5 rerank, BART classification and
BART zero-shot classification, sentence-T5 embeddings; each equals its reference library (float32), and
two worker processes give what one gives.

monoT5 scores `Query: q Document: d Relevant:` by the first decoder step's `true` against `false` logit;
the engine runs the encoder and that one decoder step per pair, batched like any other rerank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import ClassifyParams, EmbedParams, RerankParams
from tests.helpers.seq2seq_models import (
    build_tiny_bart_nli,
    build_tiny_monot5,
    build_tiny_sentence_t5,
    t5_true_false_ids,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seq2seq-prefill")
    return {
        "monot5": build_tiny_monot5(tmp),
        "bart-nli": build_tiny_bart_nli(tmp, max_position_embeddings=514),
        "sentence-t5": build_tiny_sentence_t5(tmp),
    }


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return [" ".join(t.split()[: 3 + 7 * i]) for i, t in enumerate(stdlib_texts(10, seed=21))]


QUERY = "how do I read a file line by line"


def _monot5_reference(model_dir, query: str, documents: list[str]) -> np.ndarray:
    """logit(true) - logit(false) at the first decoder step, one unpadded input at a time."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), attn_implementation="eager").float().eval()
    true_id, false_id = t5_true_false_ids(model_dir)
    start = torch.tensor([[model.config.decoder_start_token_id]])
    out = []
    with torch.no_grad():
        for document in documents:
            ids = tokenizer(f"Query: {query} Document: {document} Relevant:", return_tensors="pt").input_ids
            logits = model(input_ids=ids, decoder_input_ids=start).logits[0, 0]
            out.append(float(logits[true_id] - logits[false_id]))
    return np.array(out)


def test_monot5_rerank_equals_transformers_first_step_logits(built, engine_for, documents):
    want = _monot5_reference(built["monot5"], QUERY, documents)
    engine = engine_for(built["monot5"])
    assert engine.info.is_encoder_decoder and engine.info.tasks == ("rerank",)
    raw = engine.rerank(QUERY, documents, RerankParams(raw_scores=True))
    got = np.array([r.score for r in sorted(raw.results, key=lambda r: r.index)])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Scores: softmax over [false, true] -> true, the sigmoid of the difference; best first.
    scored = engine.rerank(QUERY, documents, RerankParams(top_n=3))
    order = np.argsort(-want, kind="stable")[:3]
    assert [r.index for r in scored.results] == order.tolist()
    np.testing.assert_allclose([r.score for r in scored.results], 1 / (1 + np.exp(-want[order])), atol=1e-5)


def test_monot5_cuts_the_document_never_the_query(built, engine_for):
    engine = engine_for(built["monot5"])
    long_document = " ".join(stdlib_texts(40, seed=2))
    with pytest.raises(Exception, match="document 0"):
        engine.rerank(QUERY, [long_document], RerankParams())
    result = engine.rerank(QUERY, [long_document, "short"], RerankParams(truncate=True))
    assert len(result.results) == 2
    with pytest.raises(Exception, match="shorten the query"):
        engine.rerank(long_document, ["short"], RerankParams(truncate=True))


def test_bart_classifier_equals_transformers(built, engine_for, documents):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = built["bart-nli"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        want = np.stack(
            [model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1).numpy() for text in documents]
        )
    engine = engine_for(model_dir)
    result = engine.classify(documents, ClassifyParams())
    assert result.labels == ("contradiction", "neutral", "entailment")
    np.testing.assert_allclose(result.scores, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("multi_label", [False, True])
def test_bart_zero_shot_equals_the_transformers_pipeline(built, engine_for, documents, multi_label):
    from transformers import pipeline

    model_dir = built["bart-nli"]
    labels = ["files", "networking", "math"]
    classifier = pipeline("zero-shot-classification", model=str(model_dir), tokenizer=str(model_dir))
    engine = engine_for(model_dir)
    params = ClassifyParams(candidate_labels=tuple(labels), multi_label=multi_label)
    result = engine.classify(documents[:5], params)
    for row, text in zip(result.scores, documents[:5], strict=True):
        reference = classifier(text, candidate_labels=labels, multi_label=multi_label)
        want = dict(zip(reference["labels"], reference["scores"], strict=True))
        np.testing.assert_allclose(row, [want[label] for label in labels], atol=1e-4, rtol=0)


def test_sentence_t5_embeds_like_sentence_transformers(built, engine_for, documents):
    from sentence_transformers import SentenceTransformer

    model_dir = built["sentence-t5"]
    want = SentenceTransformer(str(model_dir), device="cpu").encode(documents, convert_to_numpy=True)
    engine = engine_for(model_dir)
    assert not engine.info.is_encoder_decoder and "embed" in engine.info.tasks
    # sentence-transformers cuts at max_seq_length (128) without asking.
    got = engine.embed(documents, EmbedParams(truncate=True)).embeddings
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, cosine


def test_two_workers_rerank_and_classify_as_one(built, documents):
    """Same ranking; scores equal up to float rounding (1e-6): unlike the encoders' path, these models'
    results move in the last bits with the batch they run in (a document scored alone and with nine
    others differ by about 1e-7, on every backend), and two workers batch differently."""

    def run(workers: int):
        results = []
        for key in ("monot5", "bart-nli"):
            config = ModelConfig(path=str(built[key]), served_name="m", data_parallel_size=workers, warm_up=False)
            with SyncEngine(config, worker_processes=workers > 1) as engine:
                if key == "monot5":
                    results.append(
                        [(r.index, r.score) for r in engine.rerank(QUERY, documents, RerankParams()).results]
                    )
                else:
                    results.append(engine.classify(documents, ClassifyParams()).scores)
        return results

    one, two = run(1), run(2)
    assert [index for index, _ in one[0]] == [index for index, _ in two[0]]
    np.testing.assert_allclose([s for _, s in one[0]], [s for _, s in two[0]], atol=1e-6, rtol=0)
    np.testing.assert_allclose(one[1], two[1], atol=1e-6, rtol=0)


def test_t5_start_up_refusals(built):
    from embedserv.errors import ConfigError
    from embedserv.models.loading.spec_reader import read_model_spec

    with pytest.raises(ConfigError, match="overflow float16.*bfloat16"):
        read_model_spec(ModelConfig(path=str(built["monot5"]), served_name="m", dtype="float16"))
    for backend in ("varlen", "flash_attn"):
        with pytest.raises(ConfigError, match=f"--attention-backend {backend} cannot run here"):
            read_model_spec(ModelConfig(path=str(built["monot5"]), served_name="m", attention_backend=backend))
    spec = read_model_spec(ModelConfig(path=str(built["monot5"]), served_name="m"))
    assert spec.info.is_encoder_decoder and spec.info.pooling == "lasttoken"
