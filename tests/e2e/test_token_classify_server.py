"""ClassifyTokens over gRPC, POST /v1/classify_tokens over HTTP and the client's classify_tokens, against one
in-process server with a tiny BERT token classifier and the bundled embedder: the answers equal
transformers' pipeline("token-classification"), the faces agree with each other, ListModels reports the task
and labels, and bad calls get INVALID_ARGUMENT / 400 with a message naming what to change."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import assert_openai_error
from tests.helpers.inprocess import in_process_server
from tests.helpers.server import free_port
from tests.helpers.token_classifier_models import NER_LABELS, NER_TEXTS, build_token_classifier, pipeline_entities

TAGGER, EMBEDDER = "tagger", "embedder"
TEXTS = NER_TEXTS[:3]


@pytest.fixture(scope="module")
def tagger_dir(tmp_path_factory):
    return build_token_classifier(tmp_path_factory.mktemp("e2e-token-classify"), "bert")


@pytest.fixture(scope="module")
def server(tagger_dir, bundled_dir):
    http_port = free_port()
    args = ["--dtype", "float32", "--device", "cpu", "--http-port", str(http_port),
            "--model", str(tagger_dir), "--served-model-name", TAGGER,
            "--model", str(bundled_dir), "--served-model-name", EMBEDDER]  # fmt: skip
    with in_process_server(args) as (target, _):
        yield target, f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def target(server):
    return server[0]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=RPC_TIMEOUT_S) as client:
        yield client


def _pipeline_dicts(entities, strategy: str) -> list[dict]:
    """The pipeline's dicts with plain numbers, scores apart."""
    return [{k: (v if isinstance(v, str) else int(v)) for k, v in e.items() if k != "score"} for e in entities]


def test_grpc_tokens_and_entities_equal_the_pipeline(stub, pb, tagger_dir):
    expected = pipeline_entities(tagger_dir, TEXTS, "average")
    request = pb.ClassifyTokensRequest(model=TAGGER, inputs=TEXTS, aggregation=pb.AGGREGATION_AVERAGE, all_scores=True)

    response = stub.ClassifyTokens(request, timeout=RPC_TIMEOUT_S)

    assert response.model == TAGGER and response.usage.prompt_tokens > 0 and len(response.inputs) == len(TEXTS)
    for text, answer, want in zip(TEXTS, response.inputs, expected, strict=True):
        got = [
            {"entity_group": e.label, "word": e.word, "start": e.start, "end": e.end}
            for e in answer.entities
            if not e.HasField("index")
        ]
        assert got == _pipeline_dicts(want, "average")
        np.testing.assert_allclose([e.score for e in answer.entities], [w["score"] for w in want], atol=1e-4)
        for token in answer.tokens:
            assert len(token.scores) == len(NER_LABELS) and token.label == NER_LABELS[int(np.argmax(token.scores))]
            assert token.score == pytest.approx(max(token.scores)) and token.index > 0
        # Offsets into the text as sent: each span is as long as its token's text (accents stripped, ## dropped).
        spans = [(text[t.start : t.end], t.token.removeprefix("##")) for t in answer.tokens if t.token != "[UNK]"]
        assert all(len(covered) == len(token) for covered, token in spans), spans


def test_grpc_ignore_labels_unset_set_and_empty(stub, pb):
    def labels(**fields) -> set[str]:
        request = pb.ClassifyTokensRequest(model=TAGGER, inputs=TEXTS, **fields)
        return {
            e.label for answer in stub.ClassifyTokens(request, timeout=RPC_TIMEOUT_S).inputs for e in answer.entities
        }

    everything = labels(ignore_labels=pb.LabelList())
    assert "O" in everything and "O" not in labels()
    assert labels(ignore_labels=pb.LabelList(labels=["B-PER", "O"])) == everything - {"B-PER", "O"}


def test_http_equals_grpc_and_the_pipeline_dicts(stub, pb, http, tagger_dir):
    grpc_answer = stub.ClassifyTokens(
        pb.ClassifyTokensRequest(model=TAGGER, inputs=TEXTS, aggregation=pb.AGGREGATION_NONE), timeout=RPC_TIMEOUT_S
    )
    reply = http.post("/v1/classify_tokens", json={"model": TAGGER, "input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == TAGGER and body["usage"]["prompt_tokens"] > 0
    expected = pipeline_entities(tagger_dir, TEXTS, "none")
    for index, (item, answer, want) in enumerate(zip(body["data"], grpc_answer.inputs, expected, strict=True)):
        assert item["index"] == index
        assert [{k: v for k, v in e.items() if k != "score"} for e in item["entities"]] == _pipeline_dicts(want, "none")
        np.testing.assert_allclose([e["score"] for e in item["entities"]], [w["score"] for w in want], atol=1e-4)
        assert [(t["index"], t["token"], t["start"], t["end"], t["label"]) for t in item["tokens"]] == [
            (t.index, t.token, t.start, t.end, t.label) for t in answer.tokens
        ]
        assert all("scores" not in t for t in item["tokens"])
    one = http.post(
        "/v1/classify_tokens", json={"input": TEXTS[0], "aggregation_strategy": "simple", "ignore_labels": []}
    ).json()
    assert one["model"] == TAGGER, "unnamed: the first model that classifies tokens"
    assert len(one["data"]) == 1 and {e["entity_group"] for e in one["data"][0]["entities"]} & {"O"}


def test_http_errors(http):
    assert_openai_error(http.post("/v1/classify_tokens", json={"model": TAGGER, "input": 5}), 400, "input")
    assert_openai_error(http.post("/v1/classify_tokens", json={"model": TAGGER, "input": []}), 400)
    bad = http.post("/v1/classify_tokens", json={"model": TAGGER, "input": "a", "aggregation_strategy": "longest"})
    assert_openai_error(bad, 400, "aggregation_strategy")
    refused = assert_openai_error(http.post("/v1/classify_tokens", json={"model": EMBEDDER, "input": "a"}), 400)
    assert "cannot serve ClassifyTokens" in refused["message"]


def test_grpc_refusals_name_what_to_change(stub, pb):
    with pytest.raises(grpc.RpcError) as refused:
        stub.ClassifyTokens(pb.ClassifyTokensRequest(model=EMBEDDER, inputs=["a"]), timeout=RPC_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot serve ClassifyTokens; it serves: embed" in refused.value.details()
    with pytest.raises(grpc.RpcError) as wrong_call:
        stub.Embed(pb.EmbedRequest(model=TAGGER, inputs=["a"]), timeout=RPC_TIMEOUT_S)
    assert wrong_call.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "it serves: token_classify" in wrong_call.value.details()
    with pytest.raises(grpc.RpcError) as bad_enum:
        stub.ClassifyTokens(pb.ClassifyTokensRequest(model=TAGGER, inputs=["a"], aggregation=9), timeout=RPC_TIMEOUT_S)
    assert bad_enum.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "aggregation" in bad_enum.value.details()


def test_list_models_reports_the_task_and_labels(stub, pb):
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    assert list(models[TAGGER].tasks) == [pb.TASK_TOKEN_CLASSIFY]
    assert tuple(models[TAGGER].labels) == NER_LABELS and models[TAGGER].dimension == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_client_classify_tokens(kind, target, stub, pb):
    from tests.helpers.client_drivers import driver

    expected = stub.ClassifyTokens(
        pb.ClassifyTokensRequest(model=TAGGER, inputs=TEXTS, aggregation=pb.AGGREGATION_FIRST), timeout=RPC_TIMEOUT_S
    )
    client = driver(kind, target, model=TAGGER, batch_size=2)
    try:
        results = client.classify_tokens(TEXTS, aggregation="first")
        one = client.classify_tokens(TEXTS[0], ignore_labels=[], all_scores=True)
        with pytest.raises(ValueError, match="aggregation must be one of"):
            client.classify_tokens(TEXTS, aggregation="longest")
    finally:
        client.close()
    assert len(results) == len(TEXTS), "split over two requests (batch_size 2), merged in order"
    for result, answer in zip(results, expected.inputs, strict=True):
        assert [(e.label, e.word, e.start, e.end) for e in result.entities] == [
            (e.label, e.word, e.start, e.end) for e in answer.entities
        ]
        assert all(e.index is None for e in result.entities)
    assert len(one.tokens[0].scores) == len(NER_LABELS) and one.entities[0].index == one.tokens[0].index
