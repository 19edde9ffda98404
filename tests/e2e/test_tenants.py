"""Named API keys on a live server: each key's calls carry its tenant and default priority over gRPC and HTTP,
a call past its key's share of the admission limit is refused naming the share, and unknown keys are refused.
One in-process server with the bundled MiniLM and --api-keys-file."""

from __future__ import annotations

import grpc
import httpx
import pytest

from embedserv.engine.core import prefill_work
from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.server import free_port

KEYS = """
- {name: search, key: key-search-1, priority: 10}
- {name: indexer, key: key-index-2, priority: -1, max_share: 0.25}
"""


@pytest.fixture(scope="module")
def server(bundled_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS)
    http_port = free_port()
    args = [
        "--model", str(bundled_dir), "--served-model-name", "minilm", "--api-keys-file", str(path),
        "--max-concurrent-requests", "100", "--max-client-batch-size", "64", "--http-port", str(http_port),
    ]  # fmt: skip
    with in_process_server(args) as (target, _), grpc.insecure_channel(target) as channel:
        yield inference_stub(channel), f"http://127.0.0.1:{http_port}"


@pytest.fixture
def stamped(monkeypatch) -> list[tuple[int, str]]:
    seen: list[tuple[int, str]] = []
    real = prefill_work.stamp

    def record(request, default):
        real(request, default)
        seen.append((request.priority, request.tenant))
        return request

    monkeypatch.setattr(prefill_work, "stamp", record)
    return seen


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_a_keys_calls_carry_its_tenant_and_default_priority(server, stamped):
    stub, http = server
    stub.Embed(embed_request(["from search"]), metadata=_bearer("key-search-1"), timeout=RPC_TIMEOUT_S)
    # The call's own priority wins over its key's default.
    stub.Embed(embed_request(["indexer, urgent"]), metadata=(*_bearer("key-index-2"), ("x-priority", "3")))
    reply = httpx.post(
        f"{http}/v1/embeddings", json={"input": "over http"}, headers={"authorization": "Bearer key-index-2"}
    )
    assert reply.status_code == 200, reply.text
    assert stamped == [(10, "search"), (3, "indexer"), (-1, "indexer")]


def test_a_call_past_its_keys_share_is_refused_naming_it(server, stamped):
    stub, http = server
    # The indexer may hold 25 of the server's 100 inputs: a call of 30 is refused whole, at once.
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(embed_request(["x"] * 30), metadata=_bearer("key-index-2"), timeout=RPC_TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "share of 25 inputs in flight" in caught.value.details()
    indexer = {"authorization": "Bearer key-index-2"}
    reply = httpx.post(f"{http}/v1/embeddings", json={"input": ["x"] * 30}, headers=indexer)
    assert reply.status_code == 429 and "share of 25" in reply.text
    # The search key's share is half: 30 fit.
    stub.Embed(embed_request(["y"] * 30), metadata=_bearer("key-search-1"), timeout=RPC_TIMEOUT_S)
    assert len(stamped) == 30


def test_unknown_and_missing_keys_are_refused(server):
    stub, http = server
    for metadata in (_bearer("nope"), ()):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(embed_request(["x"]), metadata=metadata, timeout=RPC_TIMEOUT_S)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert httpx.post(f"{http}/v1/embeddings", json={"input": "x"}).status_code == 401
