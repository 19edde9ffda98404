"""A warm parent for the test servers: each pytest worker imports what `embedserv serve` imports once, in a process
of its own, and forks every server it starts from there.

Started as `python -m embedserv serve`, a test server spent 5.9-7.4 CPU-seconds in its own process before it was
serving on a 2-core AVX2 EPYC, nearly all of it importing torch, transformers and gRPC; forked, about 1. The
server is still a process of its own, as the tests need: its own pid, signals, children, log and exit code. What it
does not go through is the interpreter's start, which `make serve`'s test and the CLI tests still do.

The forker runs no thread and has run no torch op, so a fork copies nothing half-way (executor/zygote.py forks
workers the same way). It reaps its children and tells the pytest worker their exit codes; ForkedServer is what
the tests use of a Popen. EMBEDSERV_TEST_FORK_SERVERS=0 starts every server as a plain process instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# What a serving `embedserv serve` has imported, beyond the CLI: the server, the engine host, torch and transformers
# (the model's config and tokenizer are read through them).
_WARM_IMPORTS = (
    "embedserv.cli",
    "embedserv.server.app",
    "embedserv.server.engine_host",
    "embedserv.server.frontends",
    "torch",
    "transformers",
)


def enabled(cwd: Path) -> bool:
    """Servers of this checkout are forked unless the environment says not to (another checkout's are started)."""
    return cwd.resolve() == REPO_ROOT and os.environ.get("EMBEDSERV_TEST_FORK_SERVERS", "1") != "0"


class _Link:
    """The pytest worker's end: one forker per process, started at its first server; JSON lines both ways."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.server_fork", str(theirs.fileno())],
            cwd=REPO_ROOT, env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.buffer = b""
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        atexit.register(self.close)

    def close(self) -> None:
        """End the forker (it kills any server left) and reap it, so that its CPU time counts in this process's."""
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self, timeout: float) -> None:
        """Take in what the forker has said within `timeout` seconds (caller holds the lock)."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the test server forker exited (code {self.proc.poll()})")
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message:
                self.exits[message["exited"]] = message["code"]
            else:
                self.pids.append(message["pid"])

    def fork(self, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> int:
        request = {"args": args, "env": env, "cwd": str(cwd), "log": str(log_path)}
        with self.lock:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
            deadline = time.monotonic() + 30
            while not self.pids:
                if time.monotonic() > deadline:
                    raise RuntimeError("the test server forker did not answer in 30 s")
                self._read(1.0)
            return self.pids.pop(0)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """`pid`'s exit code once the forker has reaped it, within `timeout` seconds; None till then. (The lock is
        let go between short reads: other threads poll other servers meanwhile.)"""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if pid in self.exits:
                    return self.exits[pid]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._read(min(left, 0.05))


_link: _Link | None = None
_link_lock = threading.Lock()


def _forker() -> _Link:
    """This process's forker, started under its environment (a server's own is set after the fork)."""
    global _link
    with _link_lock:
        if _link is None or _link.proc.poll() is not None:
            _link = _Link({**os.environ, "PYTHONUNBUFFERED": "1"})
        return _link


class ForkedServer:
    """A server forked by this pytest worker's forker: what the tests use of a Popen."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.args = [sys.executable, "-m", "embedserv", *args]
        self.log_path = log_path
        self.returncode: int | None = None
        log_path.write_bytes(b"")  # there from the start, as a Popen's is
        self._link = _forker()
        self.pid = self._link.fork(args, env, cwd, log_path)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._link.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._link.exit_code(self.pid, float("inf") if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # reaped, its exit not yet read
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedServer | subprocess.Popen:
    """`python -m embedserv ARGS` under `env` in `cwd`, its output into `log_path` (the process's `log_path`): forked
    where enabled(cwd), else started."""
    if enabled(cwd):
        return ForkedServer(args, env, cwd, log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedserv", *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


# The forker's side.


def _serve_one(sock: socket.socket, request: dict) -> None:
    """In the forked child: become `python -m embedserv ARGS` and exit as it would."""
    sock.close()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.executable, *request["args"]]
    # Children that multiprocessing spawns see the main module `python -m embedserv` has, and import nothing for it.
    import importlib.util

    sys.modules["__main__"].__spec__ = importlib.util.find_spec("embedserv.__main__")
    from embedserv.cli import main

    code = 1
    try:
        code = main()  # from sys.argv, as the console script calls it: the process is the server's own
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter does with what reaches the top
        traceback.print_exc()
    finally:
        # What the interpreter does at its end: wait for the threads that are not daemons, run atexit's functions.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            sock.sendall(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _run(fd: int) -> None:
    for name in _WARM_IMPORTS:
        __import__(name)
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (their modules load on first use)

    sock = socket.socket(fileno=fd)
    buffer, children = b"", set()
    try:
        while True:
            if select.select([sock], [], [], 0.02)[0]:
                data = sock.recv(1 << 16)
                if not data:  # the pytest worker is gone
                    return
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        _serve_one(sock, request)
                    children.add(pid)
                    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _reap(sock, children)
    finally:
        for pid in children:  # servers a test left running: they would outlive the test run
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _run(int(sys.argv[1]))
