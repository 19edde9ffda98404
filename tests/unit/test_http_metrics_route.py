"""GET /metrics on the HTTP port relays the --metrics-port page (the Gateway API Inference Extension's endpoint
picker scrapes its pool's target port, our HTTP port): the same text and content type, 404 saying which flag
to give when metrics are off, 503 when the metrics port does not answer. FastAPI's TestClient on build_app,
with a real prometheus-client metrics server on a free port."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from embedserv.server.http.app import build_app
from tests.helpers.server import free_port


def _client(host: str, metrics_port: int | None) -> TestClient:
    frontend = SimpleNamespace(config=SimpleNamespace(host=host, metrics_port=metrics_port))
    return TestClient(build_app(frontend), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def metrics_port():
    registry = CollectorRegistry()
    gauge = Gauge("vllm:num_requests_waiting", "Calls waiting", ["model_name"], registry=registry)
    gauge.labels("minilm").set(3)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield server.server_port
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_metrics_port_page_is_relayed(metrics_port, host):
    reply = _client(host, metrics_port).get("/metrics")
    assert reply.status_code == 200, reply.text
    assert 'vllm:num_requests_waiting{model_name="minilm"} 3.0' in reply.text
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")


@pytest.mark.parametrize("port", [None, 0])
def test_without_a_fixed_metrics_port_it_says_which_flag_to_give(port):
    reply = _client("127.0.0.1", port).get("/metrics")
    assert reply.status_code == 404
    assert "--metrics-port" in reply.json()["error"]["message"]


def test_a_metrics_port_that_does_not_answer_is_503():
    reply = _client("127.0.0.1", free_port()).get("/metrics")
    assert reply.status_code == 503, reply.text
    assert "did not answer" in reply.json()["error"]["message"]
