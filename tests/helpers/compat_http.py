"""What the HTTP API-compatibility tests share: fixtures for an HTTP client and a gRPC stub on the session's
compat server (import them into a test module), the protobuf module, and checks of the two error shapes."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tests.helpers.client import RPC_TIMEOUT_S, inference_stub


@pytest.fixture(scope="module")
def stub(compat_server):
    with grpc.insecure_channel(compat_server.target) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="module")
def http(compat_server):
    with httpx.Client(base_url=compat_server.http, timeout=RPC_TIMEOUT_S) as client:
        yield client


def pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


def assert_openai_error(reply, status: int, param: str | None = None) -> dict:
    """OpenAI's {"error": {message, type, param, code}} with `status`; returns the inner error."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:  # a field of several types is named with the type, e.g. input.str
        assert error["param"].split(".")[0] == param
    return error


def assert_tei_error(reply, status: int, error_type: str = "validation") -> str:
    """TEI's {"error", "error_type"} with `status`; returns the message."""
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error", "error_type"} and body["error"] and body["error_type"] == error_type
    return body["error"]
