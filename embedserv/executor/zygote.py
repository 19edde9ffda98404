"""A warm parent for CPU worker and front-end processes: it imports torch and transformers once, then forks them.

Started plain (`python -m embedserv.executor.worker_main`), a worker spends most of its start importing torch and
transformers: 6 of 7 CPU-seconds for the bundled MiniLM on a 2-core AVX2 EPYC; a front end (which tokenizes, so
imports transformers, so torch) as much. Forked from a zygote, which has imported them, a worker only loads its
model. So data-parallel workers and `--frontends N` share one import, and a replacement (after a death, the
watchdog or the memory ceiling) starts in about a second instead of seven.

One zygote per worker environment, started by the first process that needs it: what the allocator's LD_PRELOAD
and OpenMP's wait policy set is read when those libraries load, so a worker must be forked from a process that
loaded them under its own environment. The thread counts are the exception: the worker sets them itself
(torch.set_num_threads), so workers of any size share one zygote. Front ends use the CPU workers' zygote: neither
setting matters to them.

Where the server's own libraries loaded under the settings its CPU workers need (the same preload, OpenMP's wait
policy: `embedserv serve` sets the latter for itself before it imports torch), the server forks the zygote from
itself before it starts a thread (fork_here), and nothing is imported twice; else it starts one plain.

The zygote forks twice per process and the middle one exits at once, so the new process is reparented to the
server, a child subreaper (prctl): the server is its parent as if it had started it. It reaps it and reads its
exit code (ForkedProcess: what the server uses of a Popen or a multiprocessing.Process), and the process dies with
it (worker_main.die_with_parent). The zygote dies with the server too. It runs no thread a fork could copy half-way
but OpenBLAS's, which is fork-safe, and never initializes CUDA. Linux only; GPU workers, other platforms, and
processes whose zygote cannot start are started as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
# The worker's own settings, which it applies after the fork: not part of a zygote's environment.
_PER_WORKER = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")
# What the C library, the allocator and OpenMP read as they load (a process forked from another keeps what that
# one read): a zygote forked from the server must have loaded under the same values of these as its processes'.
_READ_AT_LOAD = ("LD_", "MALLOC_", "GLIBC_TUNABLES", "TCMALLOC_", "OMP_", "GOMP_", "KMP_")
# The zygote's process name (ps, top, /proc/PID/comm), its workers' and its front ends' (server/frontends.py).
# What it forks shares its command line: the server's, where the server forked it.
NAME = "zygote"
WORKER_NAME = "worker"
FRONTEND_NAME = "frontend"
_FORK_TIMEOUT_S = 30.0


def _prctl(option: int, value) -> bool:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0


def supported() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("EMBEDSERV_WORKER_ZYGOTE", "1") != "0"


def cpu_thread_environment(environ) -> dict[str, str]:
    """OpenMP threads that sleep, not spin, between parallel regions (unless the user's environment says).

    A CPU worker's thread team shares the cores with the server's event loop and tokenizer. Spinning
    teammates take those cores between steps, and a team member the kernel then deschedules stalls every
    parallel region of the next step: small steps on 2 cores ran at 3-25x their cost, one-text p99 240 ms
    against 70 ms passive, with no loss on compute-bound steps (docs/performance-history.md, issue 34)."""
    return {} if "OMP_WAIT_POLICY" in environ else {"OMP_WAIT_POLICY": "PASSIVE"}


def _read_at_load(environ) -> dict[str, str]:
    names = (name for name in environ if name.startswith(_READ_AT_LOAD) and name not in _PER_WORKER)
    return {name: environ[name] for name in names}


# The values of _READ_AT_LOAD this process's libraries loaded under, where record_load_environment said so before
# torch was imported; else those it started with (/proc/self/environ).
_load_environment: dict[str, str] | None = None


def record_load_environment() -> None:
    """Notes os.environ as this process's libraries will load under it: call it before anything imports torch."""
    global _load_environment
    if "torch" not in sys.modules:
        _load_environment = _read_at_load(os.environ)


def _loaded_under() -> dict[str, str]:
    if _load_environment is not None:
        return _load_environment
    with open("/proc/self/environ", "rb") as environ:
        pairs = (os.fsdecode(entry).partition("=") for entry in environ.read().split(b"\0") if entry)
        return _read_at_load({name: value for name, _, value in pairs})


class ForkedProcess:
    """A process forked by a zygote and reparented to this one: what ProcessWorker uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its code unknown
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    # What FrontendProcesses uses of a multiprocessing.Process.
    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.poll()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int | None:
        self.join()
        return self.returncode


class Zygote:
    """The server's side of one zygote process: starts it, says when it is ready, asks it for processes."""

    def __init__(self, proc: subprocess.Popen | ForkedProcess, channel: socket.socket) -> None:
        self.proc = proc
        self._socket = channel
        self._lock = threading.Lock()
        self._ready = False
        self._socket.setblocking(False)

    @classmethod
    def start(cls, env: dict[str, str]) -> Zygote:
        """A zygote started plain under `env`: it imports what a worker imports first."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedserv.executor.worker_main", "--zygote", str(theirs.fileno()),
             str(os.getpid())],
            env=env, pass_fds=[theirs.fileno()], start_new_session=True,
        )  # fmt: skip
        theirs.close()
        return cls(proc, ours)

    @classmethod
    def forked_from_here(cls) -> Zygote:
        """A zygote forked from this process, which has imported what a worker imports and runs no other thread."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                os.setsid()
                serve(theirs.fileno(), server_pid)  # ends the process
            finally:
                os._exit(1)
        theirs.close()
        return cls(ForkedProcess(pid), ours)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Whether it has imported what a worker imports (it says so once); False while it imports or once dead."""
        if not self._ready and self.alive():
            with contextlib.suppress(BlockingIOError):
                self._ready = self._socket.recv(16) == b"ready"
        return self._ready and self.alive()

    async def started(self) -> bool:
        """Waits until it is ready (True) or has died (False)."""
        while self.alive() and not self.ready():
            await asyncio.sleep(0.02)
        return self.ready()

    def fork(self, target: Callable, args: tuple, env: dict[str, str], name: str = "") -> ForkedProcess | None:
        """A process running `target(*args)` under `env` (and named `name`, else as this interpreter), or None if
        the zygote could not fork. `target` and `args` go by pickle: a module-level function, and what it pickles."""
        # The call is unpickled in the new process, under its environment: what it imports, it imports there.
        call = pickle.dumps((target, args))
        request = pickle.dumps((env, name or os.path.basename(sys.executable), call))
        with self._lock:
            try:
                self._socket.setblocking(True)
                self._socket.settimeout(_FORK_TIMEOUT_S)
                self._socket.send(request)
                reply = json.loads(self._socket.recv(256) or b"{}")
            except (OSError, ValueError) as exc:
                logger.warning("the worker zygote (pid %d) did not fork: %s", self.proc.pid, exc)
                return None
            finally:
                self._socket.setblocking(False)
        return ForkedProcess(reply["pid"]) if reply.get("pid") else None

    def close(self) -> None:
        self._socket.close()
        if self.alive():
            self.proc.kill()
        self.proc.wait()


_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def for_environment(env: dict[str, str]) -> Zygote | None:
    """This process's zygote for processes under `env`, started now if there is none alive; None where they
    cannot be forked (not Linux, EMBEDSERV_WORKER_ZYGOTE=0, or this process cannot adopt them)."""
    if not supported():
        return None
    shared = _shared(env)
    with _zygotes_lock:
        zygote = _zygotes.get(_key(shared))
        if zygote is None or not zygote.alive():
            if zygote is not None:
                zygote.close()
            # What a zygote forks becomes this process's child (the middle process exits).
            if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
                return None
            zygote = _zygotes[_key(shared)] = Zygote.start(shared)
        return zygote


def fork_here(env: dict[str, str]) -> bool:
    """Forks this process's zygote for processes under `env` from this process, where it can stand for one started
    under `env`: this process runs no other thread and loaded its libraries under the same settings (_READ_AT_LOAD).
    False where it cannot: for_environment then starts one plain when a process is first asked for."""
    if not supported() or threading.active_count() > 1 or _read_at_load(env) != _loaded_under():
        return False
    _import_what_a_worker_imports()  # the server has (it reads models through them): nothing left to do, as a rule
    shared = _shared(env)
    with _zygotes_lock:
        if _key(shared) in _zygotes or not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
            return False
        _zygotes[_key(shared)] = Zygote.forked_from_here()
    return True


def _shared(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in _PER_WORKER}


def _key(shared: dict[str, str]) -> tuple:
    return tuple(sorted(shared.items()))


# --- the zygote process ----------------------------------------------------------------------------------------


def serve(fd: int, server_pid: int) -> None:
    """The zygote's life: import, say ready, fork a process per request until the server goes."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_NAME, NAME.encode())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != server_pid:
        os._exit(0)
    channel = socket.socket(fileno=fd)
    _import_what_a_worker_imports()
    channel.send(b"ready")
    while os.getppid() == server_pid:
        readable, _, _ = select.select([channel], [], [], 0.5)
        if not readable:
            continue
        request = channel.recv(1 << 20)
        if not request:  # the server closed its end
            break
        try:
            pid = _fork(pickle.loads(request), channel, server_pid)
        except Exception as exc:  # the server falls back to starting the process itself
            logger.error("could not fork: %s", exc)
            pid = 0
        channel.send(json.dumps({"pid": pid}).encode())
    os._exit(0)


def _import_what_a_worker_imports() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from embedserv.models.loading.spec_reader import read_model_spec  # noqa: F401
    from embedserv.worker.replica import build_runner  # noqa: F401


def _fork(request: tuple, channel: socket.socket, server_pid: int) -> int:
    """Forks a middle process that forks the new process and exits; returns the new process's pid."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                channel.close()
                _run(request, server_pid)
            os.write(write_end, str(worker).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        pid = int(pipe.read() or 0)
    os.waitpid(middle, 0)
    return pid


def _run(request: tuple, server_pid: int) -> None:
    """In the forked process: its own session, name and environment, then its target as if started plain."""
    env, name, call = request
    code = 1
    try:
        os.setsid()
        _prctl(_PR_SET_NAME, name[:15].encode())
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        # The middle process has exited by the time the zygote answers; wait for the reparenting to show.
        deadline = time.monotonic() + 5.0
        while os.getppid() != server_pid and time.monotonic() < deadline:
            time.sleep(0.001)
        target, args = pickle.loads(call)
        code = target(*args) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        logger.exception("the forked process failed")
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
