"""SIGTERM under load: calls in flight complete, new ones are refused, the server exits 0.

Also: what outlives --drain-timeout is cancelled and the exit is still 0; a second signal cancels at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import grpc
import pytest

from tests.helpers.client import embed_request, inference_stub, outcome, response_matrix
from tests.helpers.processes import named_worker_pid, survivors, wait_for, worker_pids, zygote_pids
from tests.helpers.server import exit_code, health_status, launched_server, running_server

SERVED = "minilm"
LONG_TEXT = "a text long enough to keep two cores busy for a while " * 18
IN_FLIGHT_CALLS = 4
# Four calls of 12 texts near the 256-token limit: a few seconds of work, all of it still running 0.5 s in.
TEXTS_PER_CALL = 12


# Long enough that a drain held to its timeout cannot be mistaken for slow work on a loaded machine: the exit
# must come a margin (30 s) before it.
DRAIN_TIMEOUT = 90
EXIT_BEFORE_DRAIN_TIMEOUT_S = DRAIN_TIMEOUT - 30


def _args(bundled_dir, drain_timeout: float, frontends: int = 1) -> list[str]:
    return [
        "--model", str(bundled_dir), "--served-model-name", SERVED, "--drain-timeout", str(drain_timeout),
        "--frontends", str(frontends),
    ]  # fmt: skip


# One process, and two front-end processes that the engine process drains (server/engine_host.py).
FRONTENDS = pytest.mark.parametrize("frontends", [1, 2], ids=["1-frontend", "2-frontends"])


def _wait_not_serving(target: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = health_status(target, timeout=1.0)
        if status != "SERVING":
            return status
        time.sleep(0.02)
    raise AssertionError("health still SERVING after SIGTERM")


def _long_calls(stub, count: int, texts: int) -> list:
    return [
        stub.Embed.future(embed_request([f"{i} {LONG_TEXT}"] * texts, truncate=True), timeout=120) for i in range(count)
    ]


def _watch(channel, service: str, seen: list[str]) -> threading.Thread:
    """Collects the statuses a health Watch stream sends until the stream ends."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def run() -> None:
        with contextlib.suppress(grpc.RpcError):
            for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service)):
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@FRONTENDS
def test_sigterm_under_load_finishes_in_flight_refuses_new_and_exits_0(bundled_dir, frontends):
    with running_server(_args(bundled_dir, DRAIN_TIMEOUT, frontends)) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            stub = inference_stub(channel)
            seen = {"": [], SERVED: []}
            watchers = [_watch(channel, service, statuses) for service, statuses in seen.items()]
            in_flight = _long_calls(stub, IN_FLIGHT_CALLS, TEXTS_PER_CALL)
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            unfinished = [f for f in in_flight if not f.done()]
            assert len(unfinished) >= 2, "the load ended before SIGTERM; make the calls longer"
            # NOT_SERVING, or the call is refused (UNAVAILABLE; CANCELLED when it raced the shutdown).
            _wait_not_serving(target)
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(embed_request(["a new call while draining"]), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            for future in in_flight:  # the unfinished ones among them
                assert response_matrix(future.result()).shape == (TEXTS_PER_CALL, 384)
            assert exit_code(proc, EXIT_BEFORE_DRAIN_TIMEOUT_S) == 0
            # Open Watch streams did not hold the drain to its timeout: it ended with the inference calls. The
            # calls themselves took 21 s from the signal on a loaded CI machine (2 cores, two test workers), so
            # the bound is the drain timeout less its margin, not a guess at how long the work takes.
            assert time.monotonic() - signalled < EXIT_BEFORE_DRAIN_TIMEOUT_S
            for watcher in watchers:
                watcher.join(timeout=10)
        assert "draining" in proc.log_path.read_text()
    # Watchers saw the drain as NOT_SERVING (the whole server and the model).
    assert seen == {"": ["SERVING", "NOT_SERVING"], SERVED: ["SERVING", "NOT_SERVING"]}


# The exit of a drain cut short, at most: well inside the 120 s drain of the second-signal case.
CUT_SHORT_EXIT_S = 60


def _cut_short(bundled_dir, drain_timeout: float, second_signal: bool, frontends: int) -> tuple[list, float, str]:
    """SIGTERM while about 10 s of work runs; with `second_signal`, SIGINT once draining. The calls' codes,
    the seconds from SIGTERM to the exit, and the server's log."""
    with running_server(_args(bundled_dir, drain_timeout, frontends)) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            too_long = _long_calls(inference_stub(channel), 3, 64)
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            if second_signal:
                _wait_not_serving(target)
                proc.send_signal(signal.SIGINT)
            assert exit_code(proc, CUT_SHORT_EXIT_S) == 0
            took = time.monotonic() - signalled
            codes = [outcome(f) for f in too_long]
    return codes, took, proc.log_path.read_text()


# Each way of cutting the drain short once in the default run, one with each server shape (a server start each:
# the other two corners only repeat them).
CUT_SHORT = [
    pytest.param(1, False, 1, id="1-frontend-timeout"),
    pytest.param(120, True, 2, id="2-frontends-second-signal"),
    pytest.param(1, False, 2, id="2-frontends-timeout", marks=pytest.mark.slow),
    pytest.param(120, True, 1, id="1-frontend-second-signal", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("drain_timeout, second_signal, frontends", CUT_SHORT)
def test_what_outlives_the_drain_is_cancelled_and_the_exit_is_0(bundled_dir, drain_timeout, second_signal, frontends):
    codes, took, log = _cut_short(bundled_dir, drain_timeout, second_signal, frontends)
    # The call that reached the server first may finish inside the drain; the other two, queued behind
    # it, cannot. (Which call arrives first is not the order they were sent in: concurrent HTTP/2 streams.)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, codes
    assert codes.count(grpc.StatusCode.OK) <= 1, codes
    # The drain (1 s, or until the second signal), then stopping the worker: not the 120 s drain (the codes above
    # show the work was cut short). Loose, so that a loaded machine passes: 8.4 s was seen under load on AVX-512,
    # and CI's machine ran the suite 2.5x slower than that one (pytest 1,185 s against 469 s).
    assert took < CUT_SHORT_EXIT_S, took
    assert ("second signal" in log) == second_signal


def test_sigterm_while_loading_stops_at_once_and_exits_0(bundled_dir):
    """A pod stopped while its model still loads must not finish the load first (it could take minutes)."""
    # With the warm-up, as a production server loads: long enough to tell stopping at once from loading first.
    with launched_server([*_args(bundled_dir, 60), "--warm-up"]) as (target, proc):
        # Listening, the worker process started (its log line: a zygote still importing is not one yet), the model
        # not yet warm.
        wait_for(
            lambda: (
                named_worker_pid(proc.pid, proc.log_path, f"{SERVED}/0")
                and health_status(target, timeout=1.0) == "NOT_SERVING"
            ),
            timeout=60,
            interval=0.05,
            what="a worker loading behind a NOT_SERVING server",
        )
        workers = worker_pids(proc.pid) + zygote_pids(proc.pid)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert exit_code(proc, 30) == 0
        # 1.4-1.7 s on an idle AVX2 EPYC (stopping the loading worker), 1 s on AVX-512; finishing the load
        # first took 5-6 s there. Loose, so that a loaded CI machine passes: the log below is the sharp check.
        assert time.monotonic() - signalled < 10
        # The kernel signals them as the server exits (PR_SET_PDEATHSIG); on a busy machine one may take a moment
        # to be scheduled and die.
        wait_for(lambda: not survivors(workers), 10, what=lambda: f"{survivors(workers)} to die with the server")
    text = proc.log_path.read_text()
    assert "SIGTERM while loading" in text
    # The worker was stopped inside its load: it never said it was ready (it does after the warm-up).
    assert "ready on cpu" not in text, text[-3000:]
    assert "Traceback" not in text and "never retrieved" not in text, text[-3000:]
