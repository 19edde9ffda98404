"""embedserv/tracing.py's set-up: nothing without an endpoint; with one, a provider of its own (not the
process-global one) named "embedserv" unless OTEL_SERVICE_NAME says otherwise, and a shutdown that turns
tracing off again. Nothing is exported here (no span is made)."""

from __future__ import annotations

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider

from embedserv import tracing
from tests.helpers.server import free_port


@pytest.fixture(autouse=True)
def _off_after():
    yield
    tracing.shutdown()
    tracing.use_provider(None)


def test_no_endpoint_sets_up_nothing():
    assert tracing.setup(None) is False and tracing.setup("") is False
    assert not tracing.enabled() and tracing.start("Embed", 0.0, {}, {}) is None


@pytest.mark.parametrize(("env_name", "expected"), [(None, "embedserv"), ("my-embedder", "my-embedder")])
def test_an_endpoint_sets_up_a_provider_of_its_own(monkeypatch, env_name, expected):
    if env_name is None:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    else:
        monkeypatch.setenv("OTEL_SERVICE_NAME", env_name)
    assert tracing.setup(f"http://127.0.0.1:{free_port()}") is True
    assert tracing.enabled()
    assert tracing._owned.resource.attributes["service.name"] == expected
    assert not isinstance(otel_trace.get_tracer_provider(), TracerProvider)
    tracing.shutdown()
    assert not tracing.enabled()
