"""Images sent to a server whose model takes text only (the bundled MiniLM): every face refuses them with
INVALID_ARGUMENT / 400 naming the input and ListModels' modalities, refuses URLs it would have to fetch,
and keeps answering texts; ListModels and /v1/models report the modalities and no image limits."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers.client import RPC_TIMEOUT_S, inference_stub, response_matrix
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import bundled_model_dir
from tests.helpers.server import free_port

SERVED = "minilm"


def _png() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


PNG = _png()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def server():
    http_port = free_port()
    args = [
        "--model",
        str(bundled_model_dir()),
        "--served-model-name",
        SERVED,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--http-port",
        str(http_port),
        "--max-images-per-request",
        "4",
    ]
    with in_process_server(args) as (target, _):
        with (
            grpc.insecure_channel(target) as channel,
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=RPC_TIMEOUT_S) as http,
        ):
            yield inference_stub(channel), http


def _pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


def _refused(call, request) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call(request, timeout=RPC_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return error.value.details()


def test_list_models_reports_text_only_and_the_image_limit(server):
    stub, http = server
    reply = stub.ListModels(_pb().ListModelsRequest(), timeout=RPC_TIMEOUT_S)
    (model,) = reply.models
    assert list(model.modalities) == ["text"]
    assert (model.max_image_bytes, model.max_image_pixels) == (0, 0)
    assert reply.limits.max_images_per_request == 4
    cards = http.get("/v1/models").json()["data"]
    assert cards[0]["modalities"] == ["text"]


def test_grpc_items_with_an_image_are_refused_naming_the_input(server):
    stub, _ = server
    pb = _pb()
    items = [pb.InputItem(text="a"), pb.InputItem(text="b"), pb.InputItem(image=PNG)]
    message = _refused(stub.Embed, pb.EmbedRequest(model=SERVED, items=items))
    assert message == f"model {SERVED} takes text only (ListModels modalities); input 2 is an image"
    # Numbered as the engine numbers its inputs: the images after the texts.
    message = _refused(stub.EmbedMultiVector, pb.EmbedMultiVectorRequest(model=SERVED, inputs=["q"], images=[PNG]))
    assert "takes text only" in message and "input 1 is an image" in message
    message = _refused(stub.Rerank, pb.RerankRequest(model=SERVED, query="q", document_images=[PNG]))
    assert "takes text only" in message and "input 0 is an image" in message


def test_grpc_items_of_texts_equal_inputs(server):
    stub, _ = server
    pb = _pb()
    texts = ["a cat on a mat", "page two"]
    by_items = stub.Embed(pb.EmbedRequest(model=SERVED, items=[pb.InputItem(text=t) for t in texts]))
    by_inputs = stub.Embed(pb.EmbedRequest(model=SERVED, inputs=texts))
    np.testing.assert_allclose(response_matrix(by_items), response_matrix(by_inputs), atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"inputs": ["a"], "items": [{"text": "b"}]}, "send inputs or items, not both"),
        ({"items": [{}]}, "items[0] holds neither a text nor an image"),
        ({"items": [{"text": "x" * 100_001}]}, "items[0] has 100001 characters"),
    ],
)
def test_grpc_items_misuse_is_refused(server, fields, says):
    stub, _ = server
    pb = _pb()
    items = [pb.InputItem(**item) for item in fields.pop("items", [])]
    assert says in _refused(stub.Embed, pb.EmbedRequest(model=SERVED, items=items, **fields))


def test_rerank_documents_and_images_together_are_refused(server):
    stub, _ = server
    request = _pb().RerankRequest(model=SERVED, query="q", documents=["d"], document_images=[PNG])
    assert "send documents or document_images, not both" in _refused(stub.Rerank, request)


def _openai_error(reply) -> str:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]["message"]


def test_openai_content_parts_with_an_image_are_refused(server):
    _, http = server
    part = {"type": "image_url", "image_url": {"url": DATA_URL}}
    reply = http.post("/v1/embeddings", json={"model": SERVED, "input": ["a text", part]})
    assert _openai_error(reply) == f"model {SERVED} takes text only (ListModels modalities); input 1 is an image"
    reply = http.post("/v1/embeddings", json={"model": SERVED, "messages": [{"role": "user", "content": [part]}]})
    assert "takes text only" in _openai_error(reply)


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/cat.png", "https://example.com/cat.png"])
def test_openai_http_urls_are_refused_never_fetched(server, url):
    _, http = server
    part = {"type": "image_url", "image_url": {"url": url}}
    reply = http.post("/v1/embeddings", json={"model": SERVED, "input": ["a", "b", part]})
    assert _openai_error(reply).startswith("input 2: image URLs are never fetched; send the image inline as a data URL")


def test_openai_text_parts_and_the_messages_form_embed_texts(server):
    _, http = server
    plain = http.post("/v1/embeddings", json={"model": SERVED, "input": ["a cat", "a dog"]}).json()["data"]
    parts = http.post(
        "/v1/embeddings", json={"model": SERVED, "input": ["a cat", {"type": "text", "text": "a dog"}]}
    ).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in parts], [d["embedding"] for d in plain], atol=1e-6)
    message = {"role": "user", "content": [{"type": "text", "text": "a dog"}]}
    reply = http.post("/v1/embeddings", json={"model": SERVED, "messages": [message]})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], plain[1]["embedding"], atol=1e-6)
    both = http.post("/v1/embeddings", json={"model": SERVED, "input": "x", "messages": [message]})
    assert "send input (texts, token ids or content parts) or messages" in _openai_error(both)
    assert "send input" in _openai_error(http.post("/v1/embeddings", json={"model": SERVED}))


def test_the_server_keeps_answering(server):
    stub, _ = server
    reply = stub.Embed(_pb().EmbedRequest(model=SERVED, inputs=["still here"]), timeout=RPC_TIMEOUT_S)
    assert len(reply.embeddings) == 1
