"""A front-end process of `--frontends N` (started by the engine host: server/frontends.py).

It serves gRPC and HTTP on the server's ports beside the others (SO_REUSEPORT) as a one-process server does:
a FrontendServer whose models' Cores are RemoteCores (remote_core.py), so calls are parsed, checked and
tokenized here and run by the engine host. Health follows the host's Status messages. Signals are the host's
to handle: it sends Drain (this process drains its calls and says Drained) and CancelAll (a second signal).
The process dies with its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from embedserv import logs, metrics, tracing
from embedserv.config import ServerConfig
from embedserv.engine.served_model import read_served_model
from embedserv.errors import ConfigError
from embedserv.executor.worker_main import die_with_parent
from embedserv.server.frontend import InflightLimiter
from embedserv.server.frontend_server import FrontendServer
from embedserv.server.link_messages import CancelAll, Drain, Drained, Hello, Status
from embedserv.server.remote_core import FrontendLink, RemoteCore
from embedserv.start_up import freeze_start_up_objects

logger = logging.getLogger("embedserv.server.frontend_process")
# How long the last message to the engine host (Drained, or why this front end cannot listen) may take.
_LAST_WORDS_MS = 5000


def run_frontend(
    config: ServerConfig, index: int, address: str, shared_in_flight, log_settings: tuple[str, str], parent_pid: int
) -> None:
    """The process's target (multiprocessing, spawn). `parent_pid` is the engine host's pid, taken there: a host
    killed while this process still imports has it reparented already, and os.getppid() would name the new
    parent, so the process would outlive the host."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent_pid)
    metrics.value_class_from_environment()
    level, log_format = log_settings
    logs.configure(
        level, log_format, text_format=f"%(asctime)s %(levelname)s %(name)s [front end {index} pid {os.getpid()}]: "
        "%(message)s", extra={"frontend": index, "pid": os.getpid()},
    )  # fmt: skip
    asyncio.run(_serve(config, index, address, shared_in_flight))


class _Frontend:
    """This process: a FrontendServer over RemoteCores, and what it does with the engine host's messages."""

    def __init__(self, config: ServerConfig, index: int, address: str, shared_in_flight) -> None:
        self.index = index
        self.server = FrontendServer(config, InflightLimiter.for_config(config, shared_in_flight))
        self.cores: dict[str, RemoteCore] = {}
        self.drain_grace: float | None = None
        self.draining = asyncio.Event()
        handlers = {Status: self._status, Drain: self._drain, CancelAll: self._cancel_all}
        self.link = FrontendLink(address, index, handlers)

    async def add_models(self, config: ServerConfig) -> None:
        loop = asyncio.get_running_loop()
        for model in config.models:
            served = await loop.run_in_executor(None, read_served_model, model)
            core = RemoteCore(model.served_name, self.link, served.tokenizer, config.tokenizer_threads)
            self.cores[model.served_name] = core
            self.server.add_model(model, served, core)

    def _status(self, status: Status) -> None:
        """The engine host's status (when it changes and each second): health follows what changed."""
        changed = status.started != self.server.started
        for name, model in status.models.items():
            core = self.cores.get(name)
            if core is not None:
                changed = changed or core.status().serving != model.serving
                core.update(model)
        if changed:
            self.server.status_changed(status.started)

    def _drain(self, drain: Drain) -> None:
        self.drain_grace = drain.grace
        self.draining.set()

    def _cancel_all(self, message: CancelAll) -> None:
        self._cancelling = asyncio.create_task(self.server.cancel_calls())


async def _serve(config: ServerConfig, index: int, address: str, shared_in_flight) -> None:
    frontend = _Frontend(config, index, address, shared_in_flight)
    await frontend.add_models(config)
    try:
        await frontend.server.listen()
    except ConfigError as exc:
        await frontend.link.start(Hello(index, os.getpid(), str(exc)))
        frontend.link.close(linger_ms=_LAST_WORDS_MS)
        return
    await frontend.link.start(Hello(index, os.getpid()))
    freeze_start_up_objects()
    logger.info("front end %d listening", index)
    await frontend.draining.wait()
    await frontend.server.drain(frontend.drain_grace)
    for core in frontend.cores.values():
        core.stop()
    tracing.shutdown()
    await frontend.link.send(Drained(index))
    frontend.link.close(linger_ms=_LAST_WORDS_MS)
