"""Spans leave the server by OTLP/gRPC only with --otlp-endpoint: a fake collector in this process receives
them from a `--frontends 2` server (each front end exports its own; the batch spans' sizes crossed the
engine link), under OTEL_SERVICE_NAME, as children of the caller's traceparent; a server without the flag
sends nothing even with the OTEL_* environment pointing at the collector."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from tests.helpers.client import embed_request, inference_stub
from tests.helpers.server import free_port, running_server

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
RPC_TIMEOUT_S = 60.0


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list = []

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, object]]:
        """(service.name, span) for every span received."""
        with self.lock:
            out = []
            for request in self.requests:
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        out += [(attrs.get("service.name"), span) for span in scope.spans]
            return out


@pytest.fixture
def collector():
    servicer = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


def _call(target: str, http_port: int) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = inference_stub(channel)
        stub.Embed(
            embed_request(["traced over gRPC", "two"]), metadata=(("traceparent", TRACEPARENT),), timeout=RPC_TIMEOUT_S
        )
    reply = httpx.post(
        f"http://127.0.0.1:{http_port}/embed",
        json={"inputs": ["traced over HTTP"]},
        headers={"traceparent": TRACEPARENT},
        timeout=RPC_TIMEOUT_S,
    )
    assert reply.status_code == 200, reply.text


def test_frontends_export_their_spans(collector, bundled_dir):
    servicer, endpoint = collector
    http_port = free_port()
    args = ["--model", str(bundled_dir), "--frontends", "2", "--http-port", str(http_port), "--otlp-endpoint", endpoint]
    env = {"OTEL_SERVICE_NAME": "embedserv-under-test"}
    with running_server(args, env=env) as (target, _):
        _call(target, http_port)
    # The server's stop flushed every front end's batch.
    spans = servicer.spans()
    assert {service for service, _ in spans} == {"embedserv-under-test"}
    by_name = {span.name: span for _, span in spans}
    for name in ("Embed", "POST /embed"):
        request = by_name[name]
        assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
        children = [s for _, s in spans if s.parent_span_id == request.span_id]
        assert {"tokenization", "queue", "batch", "response"} <= {c.name for c in children}, name
        for batch in (c for c in children if c.name == "batch"):
            attributes = {a.key: a.value.int_value for a in batch.attributes}
            assert attributes["embedserv.batch.sequences"] >= 1 and attributes["embedserv.batch.tokens"] > 0


def test_without_the_flag_nothing_is_sent(collector, bundled_dir):
    servicer, endpoint = collector
    http_port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
    with running_server(["--model", str(bundled_dir), "--http-port", str(http_port)], env=env) as (target, _):
        _call(target, http_port)
    assert servicer.spans() == []
