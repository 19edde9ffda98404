"""OpenTelemetry tracing on the session's compat server, its spans caught by an in-memory exporter: the
request span (server kind, named like the route / RPC) is a child of the caller's W3C traceparent over HTTP
and over gRPC, and its children are tokenization, queue, each batch (sequences and tokens) and the response;
with tracing off (the default) nothing is set up."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from embedserv import tracing
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import http, pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import EMBEDDER

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TEXTS = ["a traced call", "with two inputs"]


@pytest.fixture
def spans():
    """Every span the server ends while the test runs, exported at once."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)
        provider.shutdown()


def _finished(exporter, name: str) -> list:
    """The finished spans once one is called `name`: an HTTP call's span ends after its last byte is sent,
    which the client may have read already."""
    deadline = time.monotonic() + 30
    while not any(s.name == name for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return exporter.get_finished_spans()


def _tree(exporter, name: str):
    """The request span called `name` and its children."""
    finished = _finished(exporter, name)
    (request,) = [s for s in finished if s.name == name]
    children = [s for s in finished if s.parent is not None and s.parent.span_id == request.context.span_id]
    return request, children


def _check_tree(request, children, rpc_attributes: dict) -> None:
    assert request.kind is SpanKind.SERVER
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.parent is not None and format(request.parent.span_id, "016x") == PARENT_ID
    assert request.parent.is_remote
    for key, value in rpc_attributes.items():
        assert request.attributes[key] == value, key
    assert request.attributes["embedserv.model"] == EMBEDDER
    assert request.attributes["embedserv.inputs"] == 2 and request.attributes["embedserv.tokens"] > 0
    assert request.attributes["embedserv.request_id"]
    names = [c.name for c in sorted(children, key=lambda c: c.start_time)]
    assert names[:2] == ["tokenization", "queue"] and names[-1] == "response", names
    batches = [c for c in children if c.name == "batch"]
    assert batches and sum(b.attributes["embedserv.batch.sequences"] for b in batches) >= 2
    assert all(b.attributes["embedserv.batch.tokens"] > 0 for b in batches)
    for child in children:
        assert child.context.trace_id == request.context.trace_id
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time, child.name


def test_http_call_is_a_child_of_its_traceparent(spans, http):
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS}, headers={"traceparent": TRACEPARENT})
    assert reply.status_code == 200, reply.text
    request, children = _tree(spans, "POST /v1/embeddings")
    _check_tree(request, children, {"http.response.status_code": 200, "http.route": "/v1/embeddings"})
    assert request.attributes["embedserv.request_id"] == reply.headers["x-request-id"]


def test_grpc_call_is_a_child_of_its_traceparent(spans, stub):
    request = pb().EmbedRequest(model=EMBEDDER, inputs=TEXTS)
    stub.Embed(request, metadata=(("traceparent", TRACEPARENT),), timeout=RPC_TIMEOUT_S)
    span, children = _tree(spans, "Embed")
    _check_tree(span, children, {"rpc.system": "grpc", "rpc.grpc.status_code": 0})


def test_a_server_error_marks_the_span(spans, http):
    """A refused call (the caller's fault) is not the server's error; its span says the status."""
    reply = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert reply.status_code == 404
    (span,) = [s for s in _finished(spans, "POST /v1/embeddings") if s.name == "POST /v1/embeddings"]
    assert span.attributes["http.response.status_code"] == 404 and span.status.status_code is StatusCode.UNSET


def test_without_an_endpoint_nothing_is_set_up(http):
    assert not tracing.setup(None) and not tracing.enabled()
    assert not isinstance(otel_trace.get_tracer_provider(), TracerProvider)
    assert http.post("/embed", json={"inputs": "untraced"}).status_code == 200
