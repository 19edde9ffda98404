"""Qwen3-VL-Reranker over the rerank faces of one in-process server serving a tiny random-weight one
(tests/helpers/qwen_vl_models.py; tests/models/test_qwen_vl_rerank.py pins its scores to transformers): gRPC Rerank's
document_items (a text, an image, an image with text) and query_item (an image with its text) over text documents,
HTTP /v1/rerank's vLLM-style {"content": [parts]} documents and query, and the Python client's document_images
pairs and query_image all give Engine.rerank's scores; texts are echoed, images never. Misuses are refused naming
the fields to change."""

from __future__ import annotations

import base64

import grpc
import numpy as np
import pytest

from embedserv.types import ImageInput, RerankParams
from embedserv_client import Client
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import pb as _pb
from tests.helpers.inprocess import in_process_http_server
from tests.helpers.qwen_vl_models import build_tiny_qwen_vl
from tests.helpers.served_fixtures import http, target  # noqa: F401 (fixtures)
from tests.helpers.vision_language_models import page_image

MODEL = "tiny-vl-reranker"
ATOL = 1e-5
WIDE = page_image(64, 96, seed=1)
TALL = page_image(128, 64, seed=2, fmt="JPEG")
QUERY = "which chart shows the sales"
DOCUMENTS = ["a socket is one endpoint of a connection", ImageInput(WIDE), ImageInput(TALL, "a receipt")]
QUERY_IMAGE = ImageInput(TALL, "the total of this receipt")
TEXTS = ["a socket is one endpoint of a connection", "sales by month, as a bar chart"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    name = "tiny-qwen3-vl-reranker"
    model_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp("vl"), "qwen3_vl", seed=1, name=name, tied=True)
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu"]
    with in_process_http_server(args) as served:
        yield served


def _engine_scores(served, query, documents) -> np.ndarray:
    """Engine.rerank's scores on the server's own loop, in document order."""
    engine = served[2].server.frontend.models.get(MODEL)
    result = served[2].call(engine.reranking.rerank(query, documents, RerankParams()), RPC_TIMEOUT_S)
    return _in_order([(r.index, r.score) for r in result.results], len(documents))


@pytest.fixture(scope="module")
def expected(served) -> tuple[np.ndarray, np.ndarray]:
    """(DOCUMENTS' scores against QUERY, TEXTS' against QUERY_IMAGE)."""
    return _engine_scores(served, QUERY, DOCUMENTS), _engine_scores(served, QUERY_IMAGE, TEXTS)


def _in_order(pairs, count: int) -> np.ndarray:
    scores = np.full(count, np.nan)
    for index, score in pairs:
        scores[index] = score
    return scores


def _item(item):
    pb = _pb()
    return pb.InputItem(text=item) if isinstance(item, str) else pb.InputItem(image=item.data, image_text=item.text)


def _content(item) -> str | dict:
    """A document or query as vLLM's multimodal score input: an image_url part, then a text part if any."""
    if isinstance(item, str):
        return item
    url = "data:image/png;base64," + base64.b64encode(item.data).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}]
    return {"content": parts + ([{"type": "text", "text": item.text}] if item.text else [])}


def test_grpc_document_items_and_query_item(stub, expected):
    pb = _pb()
    items = [_item(d) for d in DOCUMENTS]
    reply = stub.Rerank(pb.RerankRequest(model=MODEL, query=QUERY, document_items=items, return_documents=True))
    got = _in_order([(r.index, r.score) for r in reply.results], 3)
    np.testing.assert_allclose(got, expected[0], rtol=0, atol=ATOL)
    assert {r.index: r.document for r in reply.results} == {0: DOCUMENTS[0], 1: "", 2: ""}
    request = pb.RerankRequest(model=MODEL, query_item=_item(QUERY_IMAGE), documents=TEXTS)
    reply = stub.Rerank(request, timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(_in_order([(r.index, r.score) for r in reply.results], 2), expected[1], atol=ATOL)


def test_http_content_documents_and_query(http, expected):
    body = {"model": MODEL, "query": QUERY, "documents": [_content(d) for d in DOCUMENTS]}
    reply = http.post("/v1/rerank", json=body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    got = _in_order([(r["index"], r["relevance_score"]) for r in results], 3)
    np.testing.assert_allclose(got, expected[0], rtol=0, atol=ATOL)
    assert {r["index"]: r.get("document") for r in results} == {0: {"text": DOCUMENTS[0]}, 1: None, 2: None}
    reply = http.post("/rerank", json={"model": MODEL, "query": _content(QUERY_IMAGE), "documents": TEXTS})
    assert reply.status_code == 200, reply.text
    got = _in_order([(r["index"], r["relevance_score"]) for r in reply.json()["results"]], 2)
    np.testing.assert_allclose(got, expected[1], rtol=0, atol=ATOL)


def test_the_client_reranks_image_documents_and_an_image_query(served, expected):
    with Client(served[0], model=MODEL) as client:
        ranked = client.rerank(QUERY, document_images=[WIDE, (TALL, DOCUMENTS[2].text)])
        by_image = client.rerank(QUERY_IMAGE.text, TEXTS, query_image=TALL, return_documents=True)
    np.testing.assert_allclose(_in_order([(r.index, r.score) for r in ranked], 2), expected[0][1:], atol=ATOL)
    np.testing.assert_allclose(_in_order([(r.index, r.score) for r in by_image], 2), expected[1], atol=ATOL)
    assert sorted(r.document for r in by_image) == sorted(TEXTS)


def _refused(stub, **fields) -> str:
    with pytest.raises(grpc.RpcError) as error:
        stub.Rerank(_pb().RerankRequest(model=MODEL, **fields), timeout=RPC_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return error.value.details()


def test_misuses_are_refused_naming_the_fields(stub, http):
    image = _item(DOCUMENTS[1])
    assert "send query or query_item, not both" in _refused(stub, query="q", query_item=image, documents=["a"])
    both = _refused(stub, query="q", documents=["a"], document_items=[image])
    assert "send documents or document_items, not both" in both
    three = _refused(stub, query="q", documents=["a"], document_images=[WIDE], document_items=[image])
    assert "send one of documents, document_images and document_items, not all three" in three
    parts = [_pb().InputPart(text="a"), _pb().InputPart(image=WIDE), _pb().InputPart(text="b")]
    mixed = _refused(stub, query_item=image, document_items=[_item("a"), _pb().InputItem(parts=parts)])
    assert "document 1 holds texts and images interleaved; Rerank takes a text, an image or an image with" in mixed
    empty = _refused(stub, query="q", document_items=[_pb().InputItem()])
    assert "document_items[0] holds neither a text nor an image" in empty
    parts = _content(DOCUMENTS[1])["content"]
    reply = http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": [{"content": parts * 2}]})
    assert reply.status_code == 400
    assert "document 0 holds texts and images interleaved" in reply.json()["error"]["message"]
