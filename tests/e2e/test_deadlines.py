"""Calls whose deadline passes or whose client cancels while they wait in the queue are never computed.

A real server is kept busy by long calls; short calls queued behind them expire (DEADLINE_EXCEEDED) or
are cancelled by their client (CANCELLED). /metrics then shows that the sequences that ran are exactly
those of the calls that succeeded, and that the others were dropped from the queue.

The short calls go at a lower priority than the long ones. So they wait behind them whatever order they reach the
engine in, and /metrics shows them queued (embedserv_sequences_waiting per priority): the cancel is sent only once
the call's inputs are in the queue, not while they are on their way there.
"""

from __future__ import annotations

import grpc
import pytest

from tests.helpers.client import embed_request, inference_stub, outcome, response_matrix
from tests.helpers.inprocess import in_process_server
from tests.helpers.metrics import scrape
from tests.helpers.processes import wait_for
from tests.helpers.server import free_port, running_server

SERVED = "minilm"
# Three calls of 24 texts at the model's 256-token limit, in steps of 8 texts: 18 steps, 2-5 s on 2 CPU cores.
BLOCKING_CALLS = 3
BLOCKING_TEXTS = 24
STEP_TOKENS = 2048
EXPIRING_CALLS = 5
EXPIRY_S = 0.4
CANCELLED_INPUTS = 3
# The short calls' priority, below the blockers' (the default, 0).
BEHIND = -1


# In this process; and as `embedserv serve --frontends 2`, whose front ends cancel over their link to the engine
# process (server/remote_core.py) and count in /metrics through the shared files (cli.py).
@pytest.fixture(scope="module", params=[1, 2], ids=["in-process", "2-frontends"])
def server(bundled_dir, request):
    metrics_port = free_port()
    args = ["--model", str(bundled_dir), "--served-model-name", SERVED, "--metrics-port", str(metrics_port),
            "--max-batch-tokens", str(STEP_TOKENS)]  # fmt: skip
    launch = in_process_server if request.param == 1 else running_server
    with launch([*args, "--frontends", str(request.param)]) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            yield inference_stub(channel), metrics_port, proc


def _waiting(metrics_port: int, priority: int) -> float:
    return scrape(metrics_port).total("embedserv_sequences_waiting", model=SERVED, priority=str(priority))


def test_expired_and_cancelled_calls_are_never_computed(server):
    """Load-tolerant: each step waits for the server's queue to show what the next one needs, and the short
    calls' lower priority keeps them behind the blockers however slow the machine is. (An
    expired call's client resets the stream a little before the server's copy of the deadline ends; the
    server still counts it DEADLINE_EXCEEDED: server/calls.py, _DEADLINE_SKEW_S.)"""
    stub, metrics_port, proc = server
    before = scrape(metrics_port)
    long_text = "a long text that keeps the model busy " * 30
    blockers = [
        stub.Embed.future(embed_request([f"{i} {long_text}"] * BLOCKING_TEXTS, truncate=True), timeout=120)
        for i in range(BLOCKING_CALLS)
    ]
    # Most of their work ahead: 8 steps or more, however fast the machine.
    wait_for(lambda: _waiting(metrics_port, 0) >= 2 * BLOCKING_TEXTS, 60, interval=0.02, what="the blockers queued")
    cancelled = stub.Embed.future(embed_request(["cancelled call"] * CANCELLED_INPUTS, priority=BEHIND), timeout=120)
    wait_for(lambda: _waiting(metrics_port, BEHIND) == CANCELLED_INPUTS, 60, interval=0.02, what="the call queued")
    expiring = [
        stub.Embed.future(embed_request([f"expiring call {i}"], priority=BEHIND), timeout=EXPIRY_S)
        for i in range(EXPIRING_CALLS)
    ]
    assert cancelled.cancel()

    assert [outcome(f) for f in expiring] == [grpc.StatusCode.DEADLINE_EXCEEDED] * EXPIRING_CALLS
    assert outcome(cancelled) is grpc.StatusCode.CANCELLED
    for future in blockers:
        assert response_matrix(future.result()).shape == (BLOCKING_TEXTS, 384)
    # The queue was busy for longer than the expired calls lived: the test measured what it meant to.
    assert all(f.result().timing.total_us > EXPIRY_S * 1e6 for f in blockers[1:])
    # Behind the dropped calls: they leave the queue before it runs.
    stub.Embed(embed_request(["after"], priority=BEHIND), timeout=30)
    after = scrape(metrics_port)

    def grew(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    calls = dict(protocol="grpc", rpc="Embed", model=SERVED)
    assert grew("embedserv_requests_total", status="OK", **calls) == BLOCKING_CALLS + 1
    assert grew("embedserv_requests_total", status="DEADLINE_EXCEEDED", **calls) == EXPIRING_CALLS
    assert grew("embedserv_requests_total", status="CANCELLED", **calls) == 1
    # What ran is exactly what succeeded: the blockers and the last call.
    ran = grew("embedserv_batch_sequences_sum", model=SERVED, kind="prefill")
    assert ran == BLOCKING_CALLS * BLOCKING_TEXTS + 1
    assert grew("embedserv_batch_tokens_sum", model=SERVED, kind="prefill") == grew(
        "embedserv_input_tokens_total", **calls
    )
    # And what did not run was dropped from the queue, not left there.
    assert grew("embedserv_dropped_sequences_total", model=SERVED) == EXPIRING_CALLS + CANCELLED_INPUTS
    assert after.value("embedserv_queue_depth", model=SERVED) == 0
    assert proc.poll() is None
