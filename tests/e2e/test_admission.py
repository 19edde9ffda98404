"""Admission and what the metrics page says about it, on a real server with --max-concurrent-requests 16.

400 concurrent Embed calls end OK or RESOURCE_EXHAUSTED (none hangs) and the server answers normally
afterwards; /metrics parses with prometheus-client's parser and counts exactly what the client saw;
--max-input-chars refuses before tokenizing; with --log-format json every log line is a JSON object,
and the batch lines name the calls they carried by the id the client sent.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from tests.helpers.client import embed_request, inference_stub, response_matrix
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, running_server

SERVED = "minilm"
LIMIT = 16
MAX_CHARS = 500
CONCURRENT_CALLS = 400
INPUTS_PER_CALL = 2
CALL_TIMEOUT_S = 60.0


# One process, and two front-end processes sharing the port, admission and /metrics (server/engine_host.py).
@pytest.fixture(scope="module", params=[1, 2], ids=["1-frontend", "2-frontends"])
def server(bundled_dir, request):
    metrics_port = free_port()
    args = [
        "--model", str(bundled_dir), "--served-model-name", SERVED,
        "--max-concurrent-requests", str(LIMIT), "--max-client-batch-size", str(LIMIT),
        "--max-input-chars", str(MAX_CHARS), "--metrics-port", str(metrics_port),
        "--log-format", "json", "--log-level", "debug", "--frontends", str(request.param),
    ]  # fmt: skip
    with running_server(args) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            yield inference_stub(channel), metrics_port, proc


def _calls_by_status(port: int) -> dict[str, float]:
    page = scrape(port)
    codes = ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT")
    return {
        code: page.value("embedserv_requests_total", protocol="grpc", rpc="Embed", model=SERVED, status=code)
        for code in codes
    }


def test_400_concurrent_calls_end_ok_or_resource_exhausted(server):
    stub, metrics_port, proc = server
    texts = [f"concurrent call number {i} about admission control" for i in range(CONCURRENT_CALLS)]
    baseline = response_matrix(stub.Embed(embed_request(texts[:1]), timeout=CALL_TIMEOUT_S))
    before = _calls_by_status(metrics_port)

    futures = [stub.Embed.future(embed_request([text] * INPUTS_PER_CALL), timeout=CALL_TIMEOUT_S) for text in texts]
    codes, messages = [], set()
    for future in futures:
        # A hang would surface here as DEADLINE_EXCEEDED and fail the assertion below.
        codes.append(future.code())
        if future.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            messages.add(future.details())
            # HTTP's Retry-After, as trailing metadata.
            assert dict(future.trailing_metadata()).get("retry-after") == "1"
    ok, refused = codes.count(grpc.StatusCode.OK), codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert ok + refused == CONCURRENT_CALLS, {c.name for c in codes}
    assert ok > 0 and refused > 0, (ok, refused)
    assert all(f"limit of {LIMIT} inputs in flight" in m for m in messages), messages
    for future in futures:
        if future.code() is grpc.StatusCode.OK:
            rows = response_matrix(future.result())
            assert rows.shape == (INPUTS_PER_CALL, 384)
            np.testing.assert_array_equal(rows[0], rows[1])

    # Afterwards: nothing left in flight, and the same answer as before the storm.
    after_storm = response_matrix(stub.Embed(embed_request(texts[:1]), timeout=CALL_TIMEOUT_S))
    np.testing.assert_allclose(after_storm, baseline, rtol=0, atol=1e-6)
    after = _calls_by_status(metrics_port)
    assert after["OK"] - before["OK"] == ok + 1
    assert after["RESOURCE_EXHAUSTED"] - before["RESOURCE_EXHAUSTED"] == refused
    assert scrape(metrics_port).value("embedserv_inputs_in_flight") == 0
    assert proc.poll() is None


def test_metrics_count_inputs_and_tokens_of_what_was_sent(server):
    stub, metrics_port, _ = server
    before = scrape(metrics_port)
    texts = ["the metrics count this call", "and this one, which is a little longer than the first"]
    response = stub.Embed(embed_request(texts), timeout=CALL_TIMEOUT_S)
    after = scrape(metrics_port)

    labels = dict(rpc="Embed", model=SERVED)
    counted = dict(protocol="grpc", **labels)
    assert after.value("embedserv_request_inputs_total", **counted) - before.value(
        "embedserv_request_inputs_total", **counted
    ) == len(texts)
    assert (
        after.value("embedserv_input_tokens_total", **counted) - before.value("embedserv_input_tokens_total", **counted)
        == response.usage.prompt_tokens
    )
    for histogram in ("embedserv_queue_seconds", "embedserv_tokenization_seconds", "embedserv_inference_seconds"):
        count = f"{histogram}_count"
        assert after.value(count, **labels) - before.value(count, **labels) == 1, histogram
    batch = dict(model=SERVED, kind="prefill")
    assert after.value("embedserv_batch_sequences_sum", **batch) - before.value(
        "embedserv_batch_sequences_sum", **batch
    ) == len(texts)
    assert (
        after.value("embedserv_batch_tokens_sum", **batch) - before.value("embedserv_batch_tokens_sum", **batch)
        == response.usage.prompt_tokens
    )
    assert after.value("embedserv_workers_ready", model=SERVED) == 1
    assert after.value("embedserv_worker_restarts_total", model=SERVED) == 0
    assert after.value("embedserv_queue_depth", model=SERVED) == 0


def test_max_input_chars_refuses_before_tokenizing(server):
    stub, metrics_port, _ = server
    before = scrape(metrics_port)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(embed_request(["fine", "x" * (MAX_CHARS + 1)]), timeout=CALL_TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"inputs[1] has {MAX_CHARS + 1} characters" in caught.value.details()
    assert "--max-input-chars" in caught.value.details()
    after = scrape(metrics_port)
    # Never tokenized nor run: no tokenization was timed, no batch ran.
    for name in ("embedserv_tokenization_seconds_count", "embedserv_batch_sequences_count"):
        assert after.total(name) == before.total(name), name
    stub.Embed(embed_request(["x" * MAX_CHARS]), timeout=CALL_TIMEOUT_S)


def test_json_logs_name_each_call_by_its_request_id(server):
    stub, _, proc = server
    request_id = "test-json-logs-7"
    _, call = stub.Embed.with_call(
        embed_request(["a call to find in the logs"]),
        metadata=(("x-request-id", request_id),),
        timeout=CALL_TIMEOUT_S,
    )
    assert (("x-request-id", request_id)) in [(m.key, m.value) for m in call.trailing_metadata()]
    lines = [line for line in proc.log_path.read_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line, the workers' too, is JSON
    batches = [e for e in entries if e["level"] == "info" and "batch of" in e["message"]]
    assert any(request_id in e["message"] for e in batches)
    mine = [e for e in entries if e.get("request_id") == request_id and e["level"] == "debug"]
    assert any("status=OK" in e["message"] for e in mine), mine
    assert any("worker" in e and "pid" in e for e in entries)


def test_a_message_past_the_derived_size_limit_is_refused_unparsed(server):
    stub, _, proc = server
    # 16 inputs of 500 four-byte characters fit; 16 inputs of 20,000 characters do not.
    fits = ["\U0001f600" * MAX_CHARS] * LIMIT
    assert response_matrix(stub.Embed(embed_request(fits, truncate=True), timeout=CALL_TIMEOUT_S)).shape[0] == LIMIT
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(embed_request(["x" * 20_000] * LIMIT), timeout=CALL_TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert proc.poll() is None
