"""Start a real `embedserv serve` on 127.0.0.1 for a test (forked: server_fork.py), wait until it is SERVING, always
stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from tests.helpers import server_fork

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 10.0
# A test server: started (Popen) or forked (server_fork.ForkedServer), with `log_path` either way.
ServerProcess = subprocess.Popen | server_fork.ForkedServer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def open_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A secure channel with `credentials`, else an insecure one."""
    if credentials is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials)


def health_status(
    target: str, service: str = "", timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """The health Check answer's status name (SERVING, NOT_SERVING, ...), or the RPC error's code name.

    `credentials` (TLS) for a server that listens with TLS; else an insecure channel."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(target, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def log_tail(log_path: Path, max_chars: int = 6000) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError as err:
        return f"<no log: {err}>"
    return text[-max_chars:]


def exit_code(proc: ServerProcess, timeout: float) -> int:
    """The server's exit code once it exits, or a failure that shows its log's end (where its stop got stuck)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = log_tail(proc.log_path)  # type: ignore[attr-defined]
        raise AssertionError(f"still running {timeout:g} s after the signal; log tail:\n{tail}") from None


def wait_until_serving(
    target: str,
    is_alive: Callable[[], bool],
    log_path: Path,
    timeout: float,
    what: str = "server",
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll health Check on service "" until SERVING (over TLS with `credentials`); raise with the log's
    tail on exit or timeout."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError(f"{what} exited before SERVING (last health: {last}); log tail:\n{log_tail(log_path)}")
        last = health_status(target, timeout=1.0, credentials=credentials)
        if last == "SERVING":
            return
        time.sleep(0.25)
    raise TimeoutError(
        f"{what} not SERVING after {timeout:.0f}s (last health: {last}); log tail:\n{log_tail(log_path)}"
    )


def stop_process(proc: ServerProcess, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S; with group=True the whole process group is signalled."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=STOP_GRACE_S)
    if group:
        # Children of the group leader (make's child, for one) may outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def launched_server(
    args: list[str],
    env: dict[str, str | None] | None = None,
    cwd: Path = REPO_ROOT,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Iterator[tuple[str, ServerProcess]]:
    """Start `python -m embedserv serve --host HOST --port P *args` without waiting for it; yield
    ("HOST:P", process) with `process.log_path`, and always stop it. Without --warm-up in `args` it
    serves with --no-warm-up. The process is forked from this checkout's warm parent (server_fork.ForkedServer,
    what the tests use of a Popen) unless EMBEDSERV_TEST_FORK_SERVERS=0 or `cwd` is another checkout.

    `env` overrides the server's environment (None removes a variable); `cwd` is the checkout whose
    embedserv runs (`-m` imports from the working directory first). `host` is a loopback address
    (127.0.0.2 too: all of 127/8 is local); `port` defaults to a free one."""
    port = free_port() if port is None else port
    # HTTP is on by default (port 8000); tests that want it pass --http-port, the others turn it off so
    # that servers never contend for one port.
    http = [] if "--http-port" in args else ["--http-port", "0"]
    # Test servers serve a few calls: the warm-up would cost more than it saves, unless a test asks for it.
    warm = [] if "--warm-up" in args else ["--no-warm-up"]
    args = ["serve", "--host", host, "--port", str(port), *http, *warm, *args]
    log_path = Path(tempfile.mkdtemp(prefix="embedserv-test-")) / "server.log"
    proc_env = server_env()
    for name, value in (env or {}).items():
        if value is None:
            proc_env.pop(name, None)
        else:
            proc_env[name] = value
    proc = server_fork.start(args, proc_env, cwd, log_path)
    try:
        yield f"{host}:{port}", proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def running_server(
    args: list[str],
    timeout: float = 180,
    env: dict[str, str | None] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    cwd: Path = REPO_ROOT,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Iterator[tuple[str, ServerProcess]]:
    """launched_server, then wait until health says SERVING; yield ("HOST:P", process).

    `credentials` are the channel credentials the readiness health checks use, for a server started
    with TLS."""
    with launched_server(args, env, cwd, host, port) as (target, proc):
        wait_until_serving(
            target, lambda: proc.poll() is None, proc.log_path, timeout, what=" ".join(proc.args),
            credentials=credentials,
        )  # fmt: skip
        yield target, proc
