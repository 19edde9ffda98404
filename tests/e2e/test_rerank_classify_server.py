"""Rerank and Classify over gRPC: one server with an embedder (bi-encoder rerank), a cross-encoder and a
3-label classifier; results as the references give them, and bad input answered INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from sentence_transformers import util

from benchmarks.corpus import stdlib_texts
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.scorers import (
    build_cross_encoder,
    build_decoder_reranker,
    classifier_reference,
    qwen3_reranker_reference,
)

EMBEDDER, CROSS, CLASSIFIER, YES_NO = "minilm", "tiny-ce", "tiny-cls", "tiny-yes-no"
QUERY = "Check whether a file is a ZIP file"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("e2e-scorers")
    # A causal LM whose path does not name a reranker: only --decoder-reranker makes it one.
    yes_no = build_decoder_reranker(root).rename(root / "tiny-qwen3-causal-lm")
    return {
        EMBEDDER: bundled_dir,
        CROSS: build_cross_encoder(root, "bert"),
        CLASSIFIER: build_cross_encoder(root, "xlm-roberta", num_labels=3),
        YES_NO: yes_no,
    }


@pytest.fixture(scope="module")
def stub(model_dirs):
    # --decoder-reranker applies to the causal LM; the encoders ignore it.
    args = ["--dtype", "float32", "--device", "cpu", "--max-client-batch-size", "32", "--decoder-reranker"]
    for name, path in model_dirs.items():
        args += ["--model", str(path), "--served-model-name", name]
    with in_process_server(args) as (target, _):
        with grpc.insecure_channel(target) as channel:
            yield inference_stub(channel)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return stdlib_texts(20, seed=7)


def _pb():
    from embedserv.v1 import embedserv_pb2 as pb

    return pb


def test_cross_encoder_rerank_top_n_with_documents(stub, model_dirs, documents):
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(model_dirs[CROSS]), device="cpu").predict([(QUERY, d) for d in documents])
    request = _pb().RerankRequest(
        model=CROSS, query=QUERY, documents=documents, top_n=3, return_documents=True, truncate=True
    )

    response = stub.Rerank(request, timeout=RPC_TIMEOUT_S)

    best = list(np.argsort(-expected, kind="stable")[:3])
    assert [r.index for r in response.results] == best
    np.testing.assert_allclose([r.score for r in response.results], expected[best], atol=1e-4)
    assert [r.document for r in response.results] == [documents[i] for i in best]
    assert response.model == CROSS and response.usage.prompt_tokens > 0
    assert response.timing.total_us >= response.timing.inference_us > 0


def test_bi_encoder_rerank_without_documents_echo(stub, bundled_reference, documents):
    expected = util.cos_sim(
        bundled_reference.encode_query(QUERY, convert_to_tensor=True),
        bundled_reference.encode_document(documents, convert_to_tensor=True),
    )[0].numpy()

    response = stub.Rerank(_pb().RerankRequest(query=QUERY, documents=documents, truncate=True), timeout=RPC_TIMEOUT_S)

    assert response.model == EMBEDDER
    assert [r.index for r in response.results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(
        sorted((r.score for r in response.results), reverse=True), np.sort(expected)[::-1], atol=1e-4
    )
    assert all(r.document == "" for r in response.results)


def test_decoder_reranker_by_flag_with_instruction(stub, model_dirs, documents):
    instruction = "Given a Python question, find the docstring that answers it"
    expected = qwen3_reranker_reference(model_dirs[YES_NO], QUERY, documents, instruction=instruction)
    request = _pb().RerankRequest(
        model=YES_NO, query=QUERY, documents=documents, truncate=True, instruction=instruction
    )

    response = stub.Rerank(request, timeout=RPC_TIMEOUT_S)

    assert [r.index for r in response.results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r.score for r in response.results], np.sort(expected)[::-1], atol=1e-4)


def test_classify_labels_and_softmax(stub, model_dirs, documents):
    logits = classifier_reference(model_dirs[CLASSIFIER], documents)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)

    response = stub.Classify(
        _pb().ClassifyRequest(model=CLASSIFIER, inputs=documents, truncate=True), timeout=RPC_TIMEOUT_S
    )

    assert len(response.classifications) == len(documents)
    for row, expected in zip(response.classifications, probabilities, strict=True):
        assert [s.label for s in row.scores] == ["negative", "neutral", "positive"]
        np.testing.assert_allclose([s.score for s in row.scores], expected, atol=1e-4)
        assert row.label == ["negative", "neutral", "positive"][int(np.argmax(expected))]
        assert row.score == pytest.approx(float(expected.max()), abs=1e-4)


def test_list_models_reports_tasks_and_labels(stub):
    pb = _pb()
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
    assert list(models[EMBEDDER].tasks) == [pb.TASK_EMBED, pb.TASK_EMBED_MULTI_VECTOR, pb.TASK_RERANK]
    assert list(models[CROSS].tasks) == [pb.TASK_RERANK, pb.TASK_CLASSIFY]
    assert list(models[CLASSIFIER].tasks) == [pb.TASK_CLASSIFY]
    assert list(models[YES_NO].tasks) == [pb.TASK_RERANK]
    assert (models[YES_NO].architecture, models[YES_NO].pooling) == ("Qwen3ForCausalLM", "lasttoken")
    assert list(models[CLASSIFIER].labels) == ["negative", "neutral", "positive"]
    assert models[CLASSIFIER].architecture == "XLMRobertaForSequenceClassification"
    assert (models[CROSS].dimension, models[CROSS].pooling) == (0, "cls")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(model=CROSS, query=QUERY), "documents is empty"),
        (dict(model=CROSS, query="", documents=["a"]), "query is empty"),
        (dict(model=CROSS, query=QUERY, documents=["a"], top_n=0), "top_n must be at least 1"),
        (dict(model=CROSS, query=QUERY, documents=["a"] * 33), "more than --max-client-batch-size 32"),
        (dict(model=CLASSIFIER, query=QUERY, documents=["a"]), "cannot serve Rerank; it serves: classify"),
        (dict(model=CROSS, query=QUERY, documents=["a"], instruction="x"), "takes no instruction"),
        (dict(model=CROSS, query=QUERY, documents=[" ".join(["word"] * 300)]), "shorten it or set truncate"),
    ],
)
def test_bad_rerank_requests_are_invalid_argument(stub, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(_pb().RerankRequest(**fields), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(model=CLASSIFIER), "inputs is empty"),
        (dict(model=EMBEDDER, inputs=["a"]), "cannot serve Classify; it serves: embed, embed_multi_vector, rerank"),
        (dict(model=CLASSIFIER, inputs=["a"], truncation_direction=7), "unknown truncation_direction 7"),
    ],
)
def test_bad_classify_requests_are_invalid_argument(stub, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(_pb().ClassifyRequest(**fields), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()


def test_embed_on_a_classifier_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(_pb().EmbedRequest(model=CLASSIFIER, inputs=["a"]), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "it serves: classify" in caught.value.details()
