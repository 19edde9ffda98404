"""The HTTP edge is gRPC's edge: API key (health and docs open), body and input limits, admission (429),
request ids, metrics labelled by protocol, /docs with no internet, and a drain on SIGTERM that lets
in-flight unary calls and SSE streams finish, answers new calls 503 and exits 0.

One server for the module; the drain test stops it, so it runs last.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.compat_server import build_chat_generator
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, launched_server, wait_until_serving

KEY = "edge-test-key"
MAX_CHARS, MAX_BATCH, MAX_CONCURRENT = 2000, 16, 32
# ServerConfig.receive_limit for these limits (no model takes images): the HTTP body limit too.
BODY_LIMIT = (MAX_BATCH + 1) * (MAX_CHARS * 4 + 16) + 64 * 1024
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def edge(bundled_dir, tmp_path_factory):
    generator = build_chat_generator(tmp_path_factory.mktemp("edge-models"))
    http_port, metrics_port = free_port(), free_port()
    args = [
        "--model",
        str(bundled_dir),
        "--served-model-name",
        "minilm",
        "--model",
        str(generator),
        "--served-model-name",
        "tiny-lm",
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
        "--api-key",
        KEY,
        "--max-input-chars",
        str(MAX_CHARS),
        "--max-client-batch-size",
        str(MAX_BATCH),
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--drain-timeout",
        "60",
        "--kv-cache-memory",
        "64MiB",
    ]
    with launched_server(args) as (target, proc):
        wait_until_serving(target, lambda: proc.poll() is None, proc.log_path, 180)
        yield dict(proc=proc, http=f"http://127.0.0.1:{http_port}", metrics_port=metrics_port)


@pytest.fixture(scope="module")
def sdk(edge):
    return openai.OpenAI(base_url=f"{edge['http']}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_health_and_docs_need_no_key_and_no_internet(edge):
    with httpx.Client(base_url=edge["http"], timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ping").status_code == 200  # SageMaker's health check sends no key
        # Scrapers (an inference gateway's endpoint picker) read the metrics port's page here too.
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and 'vllm:num_requests_running{model_name="minilm"}' in metrics.text
        page = http.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert assets and all(a.startswith("/docs/assets/") for a in assets), assets
        assert "://" not in page.text.replace("http://", "").replace("https://", "") or "cdn" not in page.text
        for asset in assets:
            assert http.get(asset).status_code == 200, asset
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)


def test_api_key_is_required_except_for_health(edge, sdk):
    assert sdk.embeddings.create(model="minilm", input="with the key").data
    wrong = openai.OpenAI(base_url=f"{edge['http']}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key is wrong"):
        wrong.embeddings.create(model="minilm", input="x")
    with httpx.Client(base_url=edge["http"], timeout=30) as http:
        missing = http.post("/v1/embeddings", json={"input": "x"})
        assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
        tei = http.post("/embed", json={"inputs": "x"})
        assert tei.status_code == 401 and set(tei.json()) == {"error", "error_type"}
        for path in ("/", "/invocations"):  # TEI's and SageMaker's inference routes need the key too
            root = http.post(path, json={"inputs": "x"})
            assert root.status_code == 401 and set(root.json()) == {"error", "error_type"}, path


def test_body_past_the_limit_is_413_with_or_without_content_length(edge):
    body = b'{"input": "' + b"x" * (BODY_LIMIT + 10) + b'"}'
    with httpx.Client(base_url=edge["http"], headers=AUTH, timeout=30) as http:
        sized = http.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
        assert sized.status_code == 413 and "limit" in sized.json()["error"]["message"]

        def chunks():
            for start in range(0, len(body), 65536):
                yield body[start : start + 65536]

        chunked = http.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413


def test_input_limits_are_400_naming_the_flag(sdk):
    with pytest.raises(openai.BadRequestError, match="--max-input-chars"):
        sdk.embeddings.create(model="minilm", input="y" * (MAX_CHARS + 1))
    # Past --max-client-batch-size the call is split server-side; past OpenAI's 2048 it is refused in API terms.
    assert len(sdk.embeddings.create(model="minilm", input=["z"] * (MAX_BATCH + 1)).data) == MAX_BATCH + 1
    with pytest.raises(openai.BadRequestError, match="at most 2048 inputs per request; got 2049"):
        sdk.embeddings.create(model="minilm", input=["z"] * 2049)


def test_request_id_in_and_out(edge):
    with httpx.Client(base_url=edge["http"], headers=AUTH, timeout=30) as http:
        mine = http.post("/v1/embeddings", json={"input": "id"}, headers={"x-request-id": "edge-42"})
        assert mine.headers["x-request-id"] == "edge-42"
        new = http.post("/v1/embeddings", json={"input": "id"})
        assert re.fullmatch(r"[0-9a-f]{16}", new.headers["x-request-id"])
        assert http.get("/nowhere").headers["x-request-id"]


def test_a_400_call_burst_ends_200_or_429_and_the_sdk_raises_rate_limit(edge):
    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=edge["http"], headers=AUTH, timeout=120, limits=limits) as http:
            calls = [
                http.post("/v1/embeddings", json={"input": [f"burst {i} {j}" for j in range(8)]}) for i in range(400)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 429} and statuses.count(200) > 0 and statuses.count(429) > 0

    async def sdk_burst() -> list:
        client = openai.AsyncOpenAI(base_url=f"{edge['http']}/v1", api_key=KEY, max_retries=0, timeout=120)
        calls = [client.embeddings.create(model="minilm", input=["sdk burst"] * MAX_BATCH) for _ in range(64)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(sdk_burst())
    assert any(isinstance(o, openai.RateLimitError) for o in outcomes)
    assert all(isinstance(o, openai.RateLimitError) or o.data for o in outcomes)
    page = scrape(edge["metrics_port"])
    http_calls = dict(protocol="http", rpc="/v1/embeddings", model="minilm")
    assert page.total("embedserv_requests_total", status="200", **http_calls) >= statuses.count(200)
    assert page.total("embedserv_requests_total", protocol="http", status="429") >= statuses.count(429)
    assert page.total("embedserv_requests_total", protocol="http", status="401") >= 2
    assert page.total("embedserv_request_inputs_total", **http_calls) >= 8 * statuses.count(200)


def _used_blocks(edge) -> float:
    return scrape(edge["metrics_port"]).total("embedserv_kv_cache_blocks", state="used")


def test_a_client_leaving_an_sse_stream_frees_its_kv_blocks_at_once(edge):
    body = {"model": "tiny-lm", "prompt": "leave early", "max_tokens": 450, "temperature": 0, "stream": True}
    with httpx.Client(base_url=edge["http"], headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            assert _used_blocks(edge) > 0
    for _ in range(100):
        if _used_blocks(edge) == 0:
            break
        time.sleep(0.05)
    assert _used_blocks(edge) == 0


def test_sigterm_lets_http_calls_and_sse_streams_finish_refuses_new_and_exits_0(edge, sdk):
    """Runs last: it stops the module's server."""
    proc = edge["proc"]
    stream = sdk.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "go on"}], max_tokens=400, temperature=0, stream=True
    )
    first = next(iter(stream))
    results: dict[int, object] = {}

    def unary(i: int) -> None:
        try:
            results[i] = sdk.completions.create(model="tiny-lm", prompt=f"call {i}", max_tokens=300, temperature=0)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=unary, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=edge["http"], headers=AUTH, timeout=30) as http:
        # Wait until the unary calls are running (their engine streams hold KV blocks), then signal.
        for _ in range(200):
            if _used_blocks(edge) > 0:
                break
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(100):
            reply = http.post("/v1/embeddings", json={"input": "after SIGTERM"})
            if reply.status_code == 503:
                refused = reply
                break
        assert refused is not None and "shutting down" in refused.json()["error"]["message"]
    rest = list(stream)
    for thread in threads:
        thread.join(timeout=120)
    assert first.choices[0].delta.role == "assistant"
    assert rest[-1].choices[0].finish_reason == "length"
    for i in range(4):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i].usage.completion_tokens == 300
    assert proc.wait(timeout=60) == 0
