"""A call's priority reaches its sequences from every face: gRPC's field and metadata, HTTP's body field and
header, the served model's default; a bad one is refused with what to send. (Ordering is the scheduler's:
tests/unit/test_priority_scheduling.py.)"""

from __future__ import annotations

import itertools

import grpc
import pytest

from embedserv.engine.core import generation, prefill_work
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import assert_openai_error, http, pb, stub  # noqa: F401 - the fixtures
from tests.helpers.compat_server import EMBEDDER, GENERATOR

_texts = (f"priority probe number {i}" for i in itertools.count())


@pytest.fixture
def stamped(monkeypatch) -> list[int]:
    """The priorities the engine stamps on the sequences and streams it queues, in order."""
    seen: list[int] = []
    for module in (prefill_work, generation):
        real = module.stamp

        def record(request, default, real=real):
            stamped_request = real(request, default)
            seen.append(stamped_request.priority)
            return stamped_request

        monkeypatch.setattr(module, "stamp", record)
    return seen


def test_grpc_field_then_metadata_then_the_default(stub, stamped):
    stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=[next(_texts)], priority=7), timeout=RPC_TIMEOUT_S)
    # The field wins over the metadata; the metadata alone sets it; neither: the model's default (0).
    request = pb().EmbedRequest(model=EMBEDDER, inputs=[next(_texts)], priority=-4)
    stub.Embed(request, metadata=(("x-priority", "9"),), timeout=RPC_TIMEOUT_S)
    stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=[next(_texts)]), metadata=(("x-priority", "3"),))
    stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=[next(_texts), next(_texts)]), timeout=RPC_TIMEOUT_S)
    assert stamped == [7, -4, 3, 0, 0]


def test_grpc_generation_stream_takes_its_priority(stub, stamped):
    request = pb().GenerateRequest(model=GENERATOR, prompt="hello", max_tokens=2, temperature=0, priority=5)
    list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert stamped == [5]


def test_http_body_field_then_header(http, stamped):
    body = {"model": EMBEDDER, "input": [next(_texts)]}
    assert http.post("/v1/embeddings", json={**body, "priority": 2}, headers={"x-priority": "8"}).status_code == 200
    assert http.post("/v1/embeddings", json=body, headers={"x-priority": "-1"}).status_code == 200
    assert http.post("/embed", json={"inputs": next(_texts), "priority": 4}).status_code == 200
    assert stamped == [2, -1, 4]


def test_bad_priorities_are_refused_naming_what_to_send(stub, http, stamped):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=["x"], priority=2_000_000), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "priority" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=["x"]), metadata=(("x-priority", "high"),))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "x-priority" in caught.value.details()
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x"}, headers={"x-priority": "urgent"})
    assert "x-priority" in assert_openai_error(reply, 400)["message"]
    assert_openai_error(http.post("/v1/embeddings", json={"model": EMBEDDER, "input": "x", "priority": "top"}), 400)
    assert stamped == []


def test_the_client_sends_its_priority_on_every_call(compat_server, stamped):
    from embedserv_client import Client

    with Client(compat_server.target, model=EMBEDDER, priority=-3) as client:
        client.embed([next(_texts), next(_texts)])
    assert stamped == [-3, -3]
