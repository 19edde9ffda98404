"""A server with --lora adapters: a request names an adapter by its own name or `<model>:<name>` and gets
that adapter's output (the base's otherwise); ListModels and /v1/models list each adapter with its base;
an unknown adapter of a served model is INVALID_ARGUMENT over gRPC and 404 over HTTP, an unknown name
NOT_FOUND / 404, both listing the served models and their adapters. The embedding cache is on: the same texts
through the base and each adapter must still give each its own vectors. With --frontends 2 the adapter crosses
the link to the engine process."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub, response_matrix
from tests.helpers.compare import cosines
from tests.helpers.inprocess import in_process_server
from tests.helpers.lora_models import BERT_TARGETS, build_adapter
from tests.helpers.models import build_tiny_encoder
from tests.helpers.server import free_port, running_server

TEXTS = ["a query about tides", "the moon pulls the sea", "bread rises with yeast"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The base model's directory and its two adapters'."""
    root = tmp_path_factory.mktemp("lora-server")
    model_dir = build_tiny_encoder(root, "bert", "mean")
    legal = build_adapter(model_dir, root / "legal", 1, r=8, lora_alpha=16, target_modules=list(BERT_TARGETS))
    med = build_adapter(model_dir, root / "med", 2, r=4, lora_alpha=4, target_modules=["query", "value"])
    return model_dir, legal, med


@pytest.fixture(scope="module")
def server(built):
    model_dir, legal, med = built
    http_port = free_port()
    args = [
        "--model", str(model_dir), "--served-model-name", "base", "--dtype", "float32", "--device", "cpu",
        "--http-port", str(http_port), "--lora", f"legal={legal}", "--lora", f"med={med}",
        # The cache's key holds the adapter: the base's entries must not answer an adapter's calls.
        "--embedding-cache", "4MiB",
    ]  # fmt: skip
    with in_process_server(args) as (target, _):
        yield target, f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server[0]) as channel:
        yield inference_stub(channel)


def _embed(stub, model: str) -> np.ndarray:
    response = stub.Embed(embed_request(TEXTS, model=model), timeout=RPC_TIMEOUT_S)
    assert response.model == (model.partition(":")[2] or model)
    return response_matrix(response)


def test_requests_pick_the_adapter_by_name(stub):
    base = _embed(stub, "base")
    legal, med = _embed(stub, "legal"), _embed(stub, "med")
    np.testing.assert_array_equal(_embed(stub, "base:legal"), legal)
    np.testing.assert_array_equal(_embed(stub, "base:med"), med)
    assert cosines(legal, base).max() < 0.99 and cosines(med, base).max() < 0.99
    assert cosines(legal, med).max() < 0.99


def test_list_models_lists_each_adapter_with_its_base(stub):
    from embedserv.v1 import embedserv_pb2 as pb

    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    assert list(models) == ["base", "legal", "med"]
    assert list(models["base"].lora_adapters) == ["legal", "med"] and models["base"].base_model == ""
    for name in ("legal", "med"):
        assert models[name].base_model == "base" and not models[name].lora_adapters
        assert models[name].dimension == models["base"].dimension


def test_health_reports_adapters_with_their_base(server):
    from tests.helpers.server import health_status

    for name in ("base", "legal", "med"):
        assert health_status(server[0], name) == "SERVING"


def test_unknown_adapters_are_refused_listing_the_served_ones(stub):
    with pytest.raises(grpc.RpcError) as refused:
        _embed(stub, "base:nope")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in refused.value.details() and "base (adapters: legal, med)" in refused.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        _embed(stub, "nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "base (adapters: legal, med)" in unknown.value.details()


def test_http_models_and_embeddings(server, stub):
    with httpx.Client(base_url=server[1], timeout=RPC_TIMEOUT_S) as http:
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert list(cards) == ["base", "legal", "med"]
        assert cards["base"]["parent"] is None and cards["base"]["root"] == "base"
        assert cards["legal"]["parent"] == "base" and cards["legal"]["root"] == "base"
        assert http.get("/v1/models/med").json()["parent"] == "base"
        reply = http.post("/v1/embeddings", json={"model": "base:legal", "input": TEXTS})
        assert reply.status_code == 200 and reply.json()["model"] == "legal"
        got = np.array([row["embedding"] for row in reply.json()["data"]], dtype=np.float32)
        np.testing.assert_allclose(got, _embed(stub, "legal"), atol=1e-6)
        for name in ("base:nope", "nope"):
            missing = http.post("/v1/embeddings", json={"model": name, "input": TEXTS})
            assert missing.status_code == 404, missing.text
            assert "base (adapters: legal, med)" in missing.json()["error"]["message"]


def test_front_end_processes_serve_the_adapters(built, stub):
    """--frontends 2: a front end puts the adapter on each sequence it sends the engine process, so every
    connection (either front end) gets the adapter's vectors, and an unknown adapter is refused there."""
    model_dir, legal, med = built
    args = [
        "--model", str(model_dir), "--served-model-name", "base", "--dtype", "float32", "--device", "cpu",
        "--frontends", "2", "--lora", f"legal={legal}", "--lora", f"med={med}",
    ]  # fmt: skip
    expected = {name: _embed(stub, name) for name in ("base", "legal", "med")}
    with running_server(args) as (target, _):
        for attempt in range(6):
            name = ("base", "legal", "base:med")[attempt % 3]
            # Its own connection each: the kernel picks a front end for it.
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                got = _embed(inference_stub(channel), name)
            np.testing.assert_allclose(got, expected[name.partition(":")[2] or name], atol=1e-5)
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
            _embed(inference_stub(channel), "base:nope")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
