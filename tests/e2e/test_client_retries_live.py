"""The client's retries against a real server: a call made while the model loads waits it out
(UNAVAILABLE, retried), and a storm past --max-concurrent-requests all succeeds (RESOURCE_EXHAUSTED,
retried), while the same storm without retries does not. The server's /metrics shows the refusals did
happen, so the passing calls prove the retries."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from embedserv_client import NO_RETRY, AsyncClient, Client, EmbedservError, RetryPolicy
from tests.helpers.inprocess import in_process_server
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, health_status, launched_server, log_tail

LIMIT = 4  # inputs in flight; each call carries 4, so a second concurrent call is refused
LONG = " ".join(["a long sentence that keeps the worker busy for a while"] * 6)  # ~70 tokens
STORM = 24
# Bounded by the call's timeout, not by attempts: on a loaded machine a storm's last call may wait behind
# all the others for many short backoffs.
PATIENT = RetryPolicy(max_attempts=1_000_000, initial_backoff=0.01, max_backoff=0.1)
STORM_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def small_server(bundled_dir):
    metrics_port = free_port()
    args = ["--model", str(bundled_dir), "--served-model-name", "minilm", "--dtype", "float32", "--device", "cpu",
            "--max-concurrent-requests", str(LIMIT), "--max-client-batch-size", str(LIMIT),
            "--metrics-port", str(metrics_port)]  # fmt: skip
    with in_process_server(args) as (target, _proc):
        yield target, metrics_port


def refused(metrics_port: int) -> float:
    return scrape(metrics_port).total("embedserv_requests_total", rpc="Embed", status="RESOURCE_EXHAUSTED")


def storm_texts(i: int) -> list[str]:
    return [f"{LONG} {i} {j}" for j in range(LIMIT)]


def test_a_storm_past_the_limit_succeeds_with_retries_sync(small_server):
    target, metrics_port = small_server
    with Client(target, model="minilm", retry=PATIENT, timeout=STORM_TIMEOUT_S) as client:
        expected = client.embed(storm_texts(0))
        before = refused(metrics_port)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: client.embed(storm_texts(i % 2)), range(STORM)))
    assert refused(metrics_port) - before > 0, "the storm never reached the limit: this test showed nothing"
    other = [r for i, r in enumerate(results) if i % 2]
    for i, matrix in enumerate(results):
        np.testing.assert_allclose(matrix, expected if i % 2 == 0 else other[0], atol=1e-5)


def test_a_storm_past_the_limit_succeeds_with_retries_async(small_server):
    target, metrics_port = small_server

    async def storm(retry: RetryPolicy) -> list:
        async with AsyncClient(target, model="minilm", retry=retry, timeout=STORM_TIMEOUT_S) as client:
            calls = [client.embed(storm_texts(i)) for i in range(STORM)]
            return await asyncio.gather(*calls, return_exceptions=True)

    before = refused(metrics_port)
    results = asyncio.run(storm(PATIENT))
    assert refused(metrics_port) - before > 0
    assert all(isinstance(r, np.ndarray) and r.shape == (LIMIT, 384) for r in results), results
    # The contrast: without retries the same storm loses calls to RESOURCE_EXHAUSTED.
    unretried = asyncio.run(storm(NO_RETRY))
    errors = [r for r in unretried if isinstance(r, EmbedservError)]
    assert errors and all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    assert "--max-concurrent-requests" in errors[0].details or "limit" in errors[0].details


def test_a_call_made_while_the_model_loads_waits_it_out(bundled_dir):
    """The server binds its port first and answers UNAVAILABLE ("still loading") until the model is
    warm; a client with a patient policy started at the same moment gets its answer."""
    args = ["--model", str(bundled_dir), "--dtype", "float32", "--device", "cpu", "--log-level", "debug"]
    with launched_server(args) as (target, proc):
        deadline = time.monotonic() + 60
        while health_status(target, timeout=1.0) != "NOT_SERVING":  # listening, still loading
            assert proc.poll() is None and time.monotonic() < deadline, log_tail(proc.log_path)
            time.sleep(0.02)
        patient = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.25)
        with Client(target, retry=patient, timeout=120) as client:
            vector = client.embed("hello while loading")
        assert vector.shape == (384,)
        log = log_tail(proc.log_path, 200_000)
        assert "Embed model=- inputs=0 tokens=0 status=UNAVAILABLE" in log, log[-3000:]
        assert "status=OK" in log


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_split_call_never_sends_more_inputs_than_the_server_admits(small_server, kind):
    """16 inputs at 4 per request, 4 requests allowed in flight, but the server admits 4 inputs: the
    client sends one request at a time, so no request is refused even with retries off. (It sent all
    4 at once before, and 3 came back RESOURCE_EXHAUSTED.)"""
    target, metrics_port = small_server
    texts = [text for i in range(4) for text in storm_texts(i)]
    before = refused(metrics_port)
    if kind == "sync":
        with Client(target, model="minilm", retry=NO_RETRY, parallel_requests=4) as client:
            matrix = client.embed(texts)
    else:

        async def run():
            async with AsyncClient(target, model="minilm", retry=NO_RETRY, parallel_requests=4) as client:
                return await client.embed(texts)

        matrix = asyncio.run(run())
    assert matrix.shape == (16, 384)
    assert refused(metrics_port) == before
