"""Data-parallel worker processes: `embedserv serve --data-parallel-size 2` on the bundled all-MiniLM-L6-v2.

One server for the module shows its two workers (children of the server, each in its own session) and
survives the SIGKILL of one of them under load: every call ends OK or UNAVAILABLE, never hangs, OK
answers are the right embeddings, health stays SERVING, a replacement worker (a new pid) brings the count
back to two, and afterwards everything is served as before. Two more servers, one each, show that
SIGTERM stops the server and its workers and that SIGKILL of the server takes its workers down too.

Workers are found through /proc (tests/helpers/processes.py): children of the server pid whose command
line names `embedserv.executor.worker_main`. Any worker a failed test leaves behind is SIGKILLed by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.client import embed_request, inference_stub, response_matrix
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.processes import (
    is_alive,
    kill_survivors,
    session_id,
    survivors,
    wait_for,
    worker_pids,
)
from tests.helpers.server import ServerProcess, exit_code, health_status, log_tail, running_server

SERVED = "minilm"
WORKERS = 2
TEXTS_PER_CALL = 4
NUM_TEXTS = 24
LOAD_THREADS = 4
# A call that outlives this deadline ends DEADLINE_EXCEEDED, which fails the test: a hang shows up.
CALL_DEADLINE_S = 30.0
# Calls in flight at the kill, or sent after it, end within this long of the kill (or of their start).
CALL_END_BOUND_S = 20.0
STARTUP_WORKERS_S = 10.0
RECOVERY_TIMEOUT_S = 60.0
# Each worker process logs this once its model is loaded: the load goes on until the replacement's does.
READY_LINE = ": ready on cpu"
SERVER_EXIT_S = 15.0
WORKERS_GONE_S = 10.0
# Calls that meet other calls in a batch may differ from a lone call in the last bits.
ATOL = 1e-5

OK, UNAVAILABLE = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE


def _args(model_dir, frontends: int = 1) -> list[str]:
    return [
        "--model", str(model_dir), "--served-model-name", SERVED,
        "--dtype", "float32", "--device", "cpu",
        "--data-parallel-size", str(WORKERS), "--frontends", str(frontends),
    ]  # fmt: skip


@dataclass
class Server:
    """A running server; `seen` collects every worker pid it ever showed, for the clean-up."""

    target: str
    proc: ServerProcess
    frontends: int = 1
    seen: set[int] = field(default_factory=set)

    def log(self) -> str:
        return log_tail(self.proc.log_path)  # type: ignore[attr-defined]

    def workers(self) -> list[int]:
        pids = worker_pids(self.proc.pid)
        self.seen.update(pids)
        return pids

    def wait_workers(self, count: int = WORKERS, timeout: float = STARTUP_WORKERS_S) -> list[int]:
        """The worker pids once there are exactly `count` of them."""

        def exactly() -> list[int] | None:
            pids = self.workers()
            return pids if len(pids) == count else None

        return wait_for(
            exactly,
            timeout,
            what=lambda: (
                f"{count} workers under server pid {self.proc.pid} (now: {self.workers()}); "
                f"server log tail:\n{self.log()}"
            ),
        )


@contextlib.contextmanager
def worker_server(model_dir, frontends: int = 1) -> Iterator[Server]:
    """running_server with the worker flags; afterwards SIGKILL any recorded worker that outlived it."""
    server = None
    try:
        with running_server(_args(model_dir, frontends)) as (target, proc):
            server = Server(target, proc, frontends)
            server.workers()
            yield server
            if proc.poll() is None:
                server.workers()
    finally:
        if server is not None:
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not survivors(server.seen), WORKERS_GONE_S)
            left = kill_survivors(server.seen)
            if left:
                warnings.warn(f"workers {left} outlived their server {server.proc.pid}; SIGKILLed them", stacklevel=1)


# One process, and two front-end processes in front of the engine process that owns the workers.
@pytest.fixture(scope="module", params=[1, 2], ids=["1-frontend", "2-frontends"])
def server(bundled_dir, request) -> Iterator[Server]:
    with worker_server(bundled_dir, request.param) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="module")
def chunks() -> list[list[str]]:
    texts = stdlib_texts(NUM_TEXTS, seed=3)
    return [texts[i : i + TEXTS_PER_CALL] for i in range(0, NUM_TEXTS, TEXTS_PER_CALL)]


def _embed(stub, batch: list[str]) -> np.ndarray:
    return response_matrix(stub.Embed(embed_request(batch, model=SERVED, truncate=True), timeout=CALL_DEADLINE_S))


@pytest.fixture(scope="module")
def baseline(stub, chunks) -> list[np.ndarray]:
    """Each chunk's embeddings from the healthy two-worker server, one call at a time."""
    return [_embed(stub, batch) for batch in chunks]


# --- the shared server ----------------------------------------------------------------------------


def test_two_workers_under_the_server_each_in_its_own_session(server):
    pids = server.wait_workers(WORKERS)
    assert len(set(pids)) == WORKERS
    for pid in pids:
        assert session_id(pid) == pid, (
            f"worker {pid} is in session {session_id(pid)}, not its own (server session "
            f"{session_id(server.proc.pid)}); log tail:\n{server.log()}"
        )
    time.sleep(1.0)
    assert server.workers() == pids, f"the workers changed while idle: {pids} -> {server.workers()}\n{server.log()}"
    assert health_status(server.target, "") == "SERVING"
    assert health_status(server.target, SERVED) == "SERVING"


@pytest.fixture(scope="module")
def reference_vectors(chunks, bundled_reference) -> np.ndarray:
    """sentence-transformers' vectors of the chunks, computed once for both servers."""
    return bundled_reference.encode([t for batch in chunks for t in batch], batch_size=32, convert_to_numpy=True)


def test_workers_embed_like_sentence_transformers(baseline, chunks, reference_vectors):
    texts = [t for batch in chunks for t in batch]
    assert_cosine_at_least(np.concatenate(baseline), reference_vectors, 0.9999, texts)


@dataclass
class Call:
    chunk: int
    started: float
    ended: float
    code: grpc.StatusCode | None  # None: not an RPC error at all
    details: str = ""
    matrix: np.ndarray | None = None


def _load(stub, chunks, first: int, stop: threading.Event, calls: list[Call], lock: threading.Lock) -> None:
    """Embed chunk after chunk until `stop`, recording every call."""
    i = first
    while not stop.is_set():
        index = i % len(chunks)
        i += 1
        started = time.monotonic()
        try:
            matrix = _embed(stub, chunks[index])
            call = Call(index, started, time.monotonic(), OK, matrix=matrix)
        except grpc.RpcError as err:
            call = Call(index, started, time.monotonic(), err.code(), err.details() or "")
        except Exception as exc:
            call = Call(index, started, time.monotonic(), None, repr(exc))
        with lock:
            calls.append(call)


def _summary(calls: list[Call], t0: float) -> str:
    codes: dict[str, int] = {}
    for c in calls:
        name = c.code.name if c.code else "NOT_AN_RPC_ERROR"
        codes[name] = codes.get(name, 0) + 1
    longest = max(calls, key=lambda c: c.ended - c.started, default=None)
    slow = f"; longest {longest.ended - longest.started:.1f}s from t={longest.started - t0:+.1f}s" if longest else ""
    return f"{len(calls)} calls, codes {codes}{slow}"


def test_sigkill_of_a_worker_under_load(server, stub, chunks, baseline):
    """The important one: a worker SIGKILLed mid-load costs at most UNAVAILABLE answers, never a hang or a
    wrong embedding; health stays SERVING; a new worker takes its place; then everything works as before."""
    before = server.wait_workers(WORKERS)
    victim = before[0]
    calls: list[Call] = []
    lock = threading.Lock()
    stop = threading.Event()
    threads = [
        threading.Thread(target=_load, args=(stub, chunks, k, stop, calls, lock), daemon=True, name=f"load-{k}")
        for k in range(LOAD_THREADS)
    ]
    health: list[tuple[float, str, str]] = []  # (seconds since the kill, service, status)
    started_at = time.monotonic()
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: sum(c.code == OK for c in list(calls)) >= 2 * LOAD_THREADS,
            CALL_DEADLINE_S,
            what=lambda: f"the load to flow ({_summary(list(calls), started_at)}); log tail:\n{server.log()}",
        )
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        def sample_health() -> None:
            for service in ("", SERVED):
                status = health_status(server.target, service, timeout=5.0)
                health.append((time.monotonic() - killed_at, service, status))

        def recovered() -> list[int] | None:
            sample_health()
            pids = server.workers()
            return pids if len(pids) == WORKERS and victim not in pids else None

        after = wait_for(
            recovered,
            RECOVERY_TIMEOUT_S,
            interval=0.2,
            what=lambda: (
                f"a replacement for worker {victim} (workers now {server.workers()}, server alive: "
                f"{server.proc.poll() is None}); {_summary(list(calls), killed_at)}; log tail:\n{server.log()}"
            ),
        )
        # Keep the load on while the replacement starts (its pid shows at once, its model takes seconds to
        # load) and on the recovered pair for a moment: until calls started after the replacement was ready.
        ready_at: list[float] = []

        def served_by_the_recovered_pair() -> bool:
            sample_health()
            if not ready_at and server.proc.log_path.read_text().count(READY_LINE) > WORKERS:  # type: ignore[attr-defined]
                ready_at.append(time.monotonic())
            return bool(ready_at) and sum(c.started > ready_at[0] for c in list(calls)) >= 2 * LOAD_THREADS

        wait_for(
            served_by_the_recovered_pair,
            RECOVERY_TIMEOUT_S,
            interval=0.2,
            what=lambda: f"calls after the recovery ({_summary(list(calls), killed_at)}); log:\n{server.log()}",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=CALL_DEADLINE_S + 10)
    log = server.log()
    summary = _summary(calls, killed_at)

    assert not [t.name for t in threads if t.is_alive()], f"load threads still waiting on a call; {summary}\n{log}"
    bad = [c for c in calls if c.code not in (OK, UNAVAILABLE)]
    assert not bad, (
        f"calls ended other than OK or UNAVAILABLE: "
        f"{[(c.code.name if c.code else None, c.details, round(c.started - killed_at, 2)) for c in bad[:5]]}; "
        f"{summary}; log tail:\n{log}"
    )
    late = [c for c in calls if c.ended >= killed_at and c.ended - max(c.started, killed_at) > CALL_END_BOUND_S]
    assert not late, (
        f"{len(late)} calls in flight at the kill or sent after it took over {CALL_END_BOUND_S:g}s "
        f"(first started at t={late[0].started - killed_at:+.1f}s, ended at t={late[0].ended - killed_at:+.1f}s "
        f"from the kill); {summary}; log tail:\n{log}"
    )
    for c in calls:
        if c.code == OK:
            np.testing.assert_allclose(
                c.matrix, baseline[c.chunk], atol=ATOL,
                err_msg=f"chunk {c.chunk}, call started at t={c.started - killed_at:+.2f}s from the kill: "
                "an OK answer with other embeddings",
            )  # fmt: skip
    served_after = [c for c in calls if c.code == OK and c.started > killed_at]
    assert served_after, f"no call sent after the kill succeeded; {summary}; log tail:\n{log}"
    not_serving = [h for h in health if h[2] != "SERVING"]
    assert health and not not_serving, (
        f"health left SERVING during the recovery: {not_serving[:5]} (of {len(health)} checks); log tail:\n{log}"
    )
    assert not is_alive(victim), f"the SIGKILLed worker {victim} still runs"
    assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}; log tail:\n{log}"
    assert set(after) & set(before) == set(before) - {victim}, f"workers {before} -> {after}: the survivor changed"

    # After the recovery: one call at a time, then all chunks at once, answers equal to those of the start.
    for index, batch in enumerate(chunks):
        np.testing.assert_allclose(_embed(stub, batch), baseline[index], atol=ATOL, err_msg=f"chunk {index}")
    results: dict[int, np.ndarray | BaseException] = {}

    def call(index: int) -> None:
        try:
            results[index] = _embed(stub, chunks[index])
        except BaseException as exc:
            results[index] = exc

    together = [threading.Thread(target=call, args=(i,)) for i in range(len(chunks))]
    for t in together:
        t.start()
    for t in together:
        t.join(timeout=CALL_DEADLINE_S + 10)
    errors = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert len(results) == len(chunks) and not errors, f"after recovery: {errors}; log tail:\n{server.log()}"
    for index, matrix in results.items():
        np.testing.assert_allclose(matrix, baseline[index], atol=ATOL, err_msg=f"chunk {index}, concurrent")
    assert sorted(server.workers()) == sorted(after), (
        f"the workers changed again after the recovery: {after} -> {server.workers()}; log tail:\n{server.log()}"
    )
    assert health_status(server.target, "") == "SERVING"
    assert health_status(server.target, SERVED) == "SERVING"


def test_cpu_workers_run_on_tcmalloc_where_it_is_installed(server):
    """--cpu-allocator auto (the default): each CPU worker maps tcmalloc; the server itself does not."""
    from embedserv.worker.allocator import find_tcmalloc

    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed here (Debian: libtcmalloc-minimal4)")
    for pid in server.wait_workers(WORKERS):
        assert "libtcmalloc" in Path(f"/proc/{pid}/maps").read_text(), f"worker {pid} runs without tcmalloc"
    assert "libtcmalloc" not in Path(f"/proc/{server.proc.pid}/maps").read_text()


def _ends_with_its_workers(server: Server, how: str) -> None:
    """SIGTERM: the server exits with code 0 within SERVER_EXIT_S; SIGKILL (no chance to clean up): it is gone.
    Either way no worker of it runs WORKERS_GONE_S after."""
    pids = server.wait_workers(WORKERS)
    sent = time.monotonic()
    if how == "SIGTERM":
        server.proc.send_signal(signal.SIGTERM)
        code = exit_code(server.proc, SERVER_EXIT_S)
        assert code == 0, f"the server exited with {code} on SIGTERM; log tail:\n{server.log()}"
    else:
        server.proc.kill()
        server.proc.wait(timeout=SERVER_EXIT_S)
    wait_for(
        lambda: not survivors(pids),
        max(0.0, WORKERS_GONE_S - (time.monotonic() - sent)),
        what=lambda: (
            f"workers {pids} to end after {how} of their server (still running: {survivors(pids)}); "
            f"log tail:\n{server.log()}"
        ),
    )


# --- last: the shared server is stopped ------------------------------------------------------------------


def test_sigterm_or_sigkill_of_the_server_takes_its_workers_down(server):
    """Last in the module on purpose (each server runs its module's tests in file order): the 1-frontend server
    gets SIGTERM, the 2-frontends one SIGKILL, after the worker kill above replaced one of their workers. Run
    with --run-slow, each signal also hits a fresh one-frontend server (below)."""
    _ends_with_its_workers(server, "SIGTERM" if server.frontends == 1 else "SIGKILL")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_fresh_servers_workers_end_with_it(bundled_dir, how):
    with worker_server(bundled_dir) as server:
        _ends_with_its_workers(server, how)
