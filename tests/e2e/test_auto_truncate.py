"""--auto-truncate (the per-model `auto_truncate` key): the same MiniLM served twice, `plain` without it and
`auto` with it. Over each face (HTTP OpenAI, HTTP TEI, gRPC Inference, gRPC tei.v1) a too-long input is
refused by `plain` and cut by `auto` to the vector an explicit truncate gives; a request's own
truncate=false still wins where the face can say it (HTTP bodies and our gRPC's optional bool; TEI's gRPC
truncate is a plain proto3 bool, which cannot say "unset", so false there is unset, as in TEI)."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest

from embedserv.tei.v1 import tei_pb2, tei_pb2_grpc
from embedserv.v1 import embedserv_pb2 as pb
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import bundled_model_dir
from tests.helpers.server import free_port

LONG = "a long text that goes on " * 120  # ~600 tokens, past MiniLM's 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto-truncate") / "embedserv.yaml"
    model = bundled_model_dir()
    path.write_text(
        f"models:\n  - path: {model}\n    served_name: plain\n"
        f"  - path: {model}\n    served_name: auto\n    auto_truncate: true\n"
    )
    http_port = free_port()
    args = ["--config", str(path), "--dtype", "float32", "--device", "cpu", "--http-port", str(http_port)]
    with in_process_server(args) as (target, _):
        with (
            grpc.insecure_channel(target) as channel,
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=RPC_TIMEOUT_S) as http,
        ):
            yield channel, http, target


@pytest.fixture(scope="module")
def cut(server):
    """LONG's vector as an explicit truncate gives it (gRPC, the plain model)."""
    reply = inference_stub(server[0]).Embed(
        pb.EmbedRequest(model="plain", inputs=[LONG], truncate=True), timeout=RPC_TIMEOUT_S
    )
    return np.array(reply.embeddings[0].values, dtype=np.float32)


def _openai(http, model: str, **fields):
    return http.post("/v1/embeddings", json={"model": model, "input": [LONG], **fields})


def test_openai(server, cut):
    http = server[1]
    refused = _openai(http, "plain")
    assert refused.status_code == 400 and "truncate" in refused.json()["error"]["message"], refused.text
    reply = _openai(http, "auto")
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], cut, atol=1e-6)
    assert _openai(http, "auto", truncate=False).status_code == 400
    assert _openai(http, "plain", truncate=True).status_code == 200
    assert [http.get(f"/v1/models/{m}").json()["auto_truncate"] for m in ("plain", "auto")] == [False, True]


def _tei(http, model: str, **fields):
    return http.post("/embed", json={"inputs": LONG, **fields}, headers={"x-embedserv-model": model})


def test_tei_http(server, cut):
    http = server[1]
    assert _tei(http, "plain").status_code == 422
    reply = _tei(http, "auto")
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()[0], cut, atol=1e-6)
    assert _tei(http, "auto", truncate=False).status_code == 422
    info = {m: http.get("/info", headers={"x-embedserv-model": m}).json()["auto_truncate"] for m in ("plain", "auto")}
    assert info == {"plain": False, "auto": True}


def test_grpc_inference(server, cut):
    stub = inference_stub(server[0])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(model="plain", inputs=[LONG]), timeout=RPC_TIMEOUT_S)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    reply = stub.Embed(pb.EmbedRequest(model="auto", inputs=[LONG]), timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(reply.embeddings[0].values, cut, atol=1e-6)
    with pytest.raises(grpc.RpcError) as still_refused:
        stub.Embed(pb.EmbedRequest(model="auto", inputs=[LONG], truncate=False), timeout=RPC_TIMEOUT_S)
    assert still_refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    models = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models
    assert {m.name: m.auto_truncate for m in models} == {"plain": False, "auto": True}


def test_python_client(server, cut):
    # truncate=None (the client's default) leaves the field unset: the model's setting decides.
    from embedserv_client import Client

    with Client(server[2]) as client:
        with pytest.raises(Exception, match="truncate"):
            client.embed([LONG], model="plain")
        np.testing.assert_allclose(client.embed([LONG], model="auto")[0], cut, atol=1e-6)
        with pytest.raises(Exception, match="truncate"):
            client.embed([LONG], model="auto", truncate=False)
        assert {m.name: m.auto_truncate for m in client.models()} == {"plain": False, "auto": True}


def test_grpc_tei(server, cut):
    stub = tei_pb2_grpc.EmbedStub(server[0])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(tei_pb2.EmbedRequest(inputs=LONG), metadata=(("x-embedserv-model", "plain"),), timeout=RPC_TIMEOUT_S)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    auto = (("x-embedserv-model", "auto"),)
    reply = stub.Embed(tei_pb2.EmbedRequest(inputs=LONG), metadata=auto, timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(reply.embeddings, cut, atol=1e-6)


def _rerank(http, model: str, **fields):
    body = {"model": model, "query": "a long text", "documents": ["short", LONG], **fields}
    return http.post("/v1/rerank", json=body)


def test_cohere_rerank(server):
    # MiniLM ranks by cosine: the long document is cut as Embed cuts it.
    http = server[1]
    assert _rerank(http, "plain").status_code == 400
    auto = _rerank(http, "auto")
    assert auto.status_code == 200, auto.text
    assert auto.json()["results"] == _rerank(http, "plain", truncate=True).json()["results"]
    assert _rerank(http, "auto", truncate=False).status_code == 400
