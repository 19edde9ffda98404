"""An embedserv server inside the test process: the server's own OneProcessServer (embedserv/server/app.py) on an
event loop in a background thread, configured by the flags `embedserv serve` takes, always stopped.

It pays no interpreter start, no torch import and, by default, no worker processes and no warm-up: the
models run in this process (LocalCore.load), as `OneProcessServer(config, worker_processes=False)` loads them.
API tests use it; tests whose subject is the process (signals, drain, worker death, front-end processes,
`make serve`)
keep tests/helpers/server.py's subprocess.

What a test read from the subprocess it reads from the yielded handle: `poll()` is None while the
server runs, `log_path` holds the log lines (in the server's --log-format) of every in-process server
alive in this process meanwhile, `pid` is this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from embedserv import logs
from embedserv.cli import build_parser, main, server_config
from embedserv.config import ServerConfig

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


class InProcessServer:
    """The handle a test gets: the running OneProcessServer, its loop and its log."""

    def __init__(self, config: ServerConfig, worker_processes: bool) -> None:
        self.config = config
        self.worker_processes = worker_processes
        self.pid = os.getpid()
        self.log_path = Path(tempfile.mkdtemp(prefix="embedserv-test-")) / "server.log"
        self.returncode: int | None = None
        self.server = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="in-process-server", daemon=True)

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.server.port}"

    def poll(self) -> int | None:
        """None while serving, as Popen.poll says of a live process."""
        return None if self.returncode is None and self._thread.is_alive() else (self.returncode or 1)

    def call(self, coroutine, timeout: float):
        """Runs `coroutine` on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _make(self):
        # grpc.aio binds a server to the loop it is made on: make it there.
        from embedserv.server.app import OneProcessServer

        return OneProcessServer(self.config, worker_processes=self.worker_processes)

    def start(self) -> None:
        self._thread.start()
        self.server = self.call(self._make(), STOP_TIMEOUT_S)
        self.call(self.server.start(), START_TIMEOUT_S)

    def stop(self) -> None:
        try:
            if self.server is not None:
                self.call(self.server.stop(STOP_GRACE_S), STOP_TIMEOUT_S)
        finally:
            self.returncode = 0
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()


@contextlib.contextmanager
def _server_log(path: Path, log_format: str, level: str) -> Iterator[None]:
    """embedserv's log records at `level` and above into `path`, formatted as the subprocess's stderr would
    be; the logger's level is put back after."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logs.JsonFormatter() if log_format == "json" else logging.Formatter(logs.TEXT_FORMAT))
    logger = logging.getLogger("embedserv")
    before = logger.level
    logger.addHandler(handler)
    # Lower only: another in-process server alive meanwhile may log at a lower level.
    wanted = logging.getLevelName(level.upper())
    logger.setLevel(min(before, wanted) if before else wanted)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
        handler.close()


def in_process_config(
    args: list[str], host: str = "127.0.0.1", port: int = 0
) -> tuple[ServerConfig, argparse.Namespace]:
    """ServerConfig and the parsed flags (--log-level, --log-format) from `embedserv serve` flags, through the CLI's
    parser and config loader. As launched_server does, HTTP is off unless `args` give --http-port, and warm-up is
    off unless they give --warm-up; port 0 takes a free port at bind time (OneProcessServer.port)."""
    http = [] if "--http-port" in args else ["--http-port", "0"]
    warm = [] if "--warm-up" in args else ["--no-warm-up"]
    parsed = build_parser().parse_args(["serve", "--host", host, "--port", str(port), *http, *warm, *args])
    return server_config(parsed), parsed


@contextlib.contextmanager
def in_process_server(
    args: list[str], worker_processes: bool = False, host: str = "127.0.0.1"
) -> Iterator[tuple[str, InProcessServer]]:
    """A OneProcessServer with `args` (embedserv serve flags) serving in this process; yield ("HOST:PORT",
    handle) once it is SERVING, and always stop it. `worker_processes` runs each model in worker
    processes, as `embedserv serve` does; else in this process, one replica."""
    config, flags = in_process_config(args, host)
    handle = InProcessServer(config, worker_processes)
    with _server_log(handle.log_path, flags.log_format, flags.log_level):
        try:
            handle.start()
            yield handle.target, handle
        finally:
            handle.stop()


def serve_main(argv: list[str], monkeypatch, caplog) -> tuple[int, str]:
    """`embedserv serve --host 127.0.0.1 --http-port 0 ARGV` through cli.main in this process, for a server
    that refuses to start: (exit code, its log). main's log set-up would point this process's root logger
    at stderr for good; it is skipped, and caplog reads the records."""
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)
    with caplog.at_level(logging.INFO, logger="embedserv"):
        code = main(["serve", "--host", "127.0.0.1", "--http-port", "0", *argv])
    return code, caplog.text


@contextlib.contextmanager
def in_process_http_server(
    args: list[str], worker_processes: bool = False
) -> Iterator[tuple[str, str, InProcessServer]]:
    """in_process_server with HTTP on a free port too: yield (gRPC "HOST:PORT", HTTP base URL, handle)."""
    from tests.helpers.server import free_port

    http_port = free_port()
    with in_process_server([*args, "--http-port", str(http_port)], worker_processes) as (target, handle):
        yield target, f"http://127.0.0.1:{http_port}", handle
