"""A schema fuzz of the HTTP APIs from their own OpenAPI document (schemathesis): whatever a client sends
to any route, the answer is never a 5xx and never hangs, and the server stays up and answers correctly
afterwards."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.compat_server import EMBEDDER, GENERATOR

# Per route: enough to reach every field's edge cases without making the default run slow.
EXAMPLES = 12
CALL_TIMEOUT_S = 60
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _operations(compat_server) -> list:
    schema = schemathesis.openapi.from_url(f"{compat_server.http}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _to_a_model_that_can(case):
    """Generation routes get the generator (the default model only embeds, so every generated request
    would stop at 'cannot generate'), with a short max_tokens to keep the fuzz quick."""
    if case.path in GENERATION_ROUTES and isinstance(case.body, dict):
        case.body["model"] = GENERATOR
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > 16:
                case.body[field] = 16
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            case.body["max_tokens"] = 16  # chat's default runs to the end of the context
    return case


def test_no_route_answers_5xx_or_hangs(compat_server):
    """Every operation of the document, EXAMPLES generated requests each (schemathesis' pytest plugin does
    not load under this pytest, so hypothesis drives its strategies directly)."""
    operations = _operations(compat_server)
    assert {"POST /v1/embeddings", "POST /v1/chat/completions"} <= {op.label for op in operations}
    for operation in operations:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy().map(_to_a_model_that_can))
        def answer_is_not_5xx(case) -> None:
            response = case.call(base_url=compat_server.http, timeout=CALL_TIMEOUT_S)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            assert response.headers.get("x-request-id")
            if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                assert "error" in response.json(), response.text[:500]

        answer_is_not_5xx()


def test_server_answers_normally_after_the_fuzz(compat_server):
    reply = httpx.post(
        f"{compat_server.http}/v1/embeddings", json={"model": EMBEDDER, "input": "still here"}, timeout=30
    )
    assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == 384
    assert httpx.get(f"{compat_server.http}/health", timeout=30).status_code == 200
