"""The server: an engine host (engine_host.py: cores, workers, /metrics) and the front end that answers calls
(frontend_server.py: gRPC and HTTP), in one of two shapes:

- OneProcessServer: both in this process, joined by direct calls; it listens first (health NOT_SERVING),
  then loads and warms the models, then serves.
- MultiFrontendServer (`--frontends N`): the engine host here, and N front-end processes joined to it by the
  link (frontends.py); this process serves no call itself.

SIGTERM or SIGINT drains: health turns NOT_SERVING, new calls are refused (HTTP: 503), calls in flight over
either protocol (SSE streams included) get up to --drain-timeout to finish, then the workers stop and the
process exits 0. A second signal cancels what is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from embedserv import tracing
from embedserv.config import ModelConfig, ServerConfig
from embedserv.engine.core.local_core import LocalCore
from embedserv.errors import ConfigError
from embedserv.executor import zygote
from embedserv.executor.process_worker import cpu_process_environment
from embedserv.server.engine_host import EngineHost, all_or_none
from embedserv.server.frontend import InflightLimiter
from embedserv.server.frontend_server import FrontendServer
from embedserv.server.frontends import FrontendProcesses
from embedserv.start_up import freeze_start_up_objects

logger = logging.getLogger(__name__)


class OneProcessServer:
    def __init__(self, config: ServerConfig, worker_processes: bool = True) -> None:
        """`worker_processes` False runs each model on a model thread of this process (EngineHost)."""
        self.host = EngineHost(config, worker_processes)
        self.limiter = InflightLimiter.for_config(config)
        self.frontend = FrontendServer(config, self.limiter)
        self.host.on_change = self._status_changed
        self.port: int | None = None

    def _status_changed(self) -> None:
        self.frontend.status_changed(self.host.started)

    def _serve_model(self, config: ModelConfig, core: LocalCore) -> None:
        self.frontend.add_model(config, core.served, core)

    async def start(self) -> None:
        await self.frontend.listen()
        self.port = self.frontend.port
        self.host.serve_metrics(lambda: self.limiter.in_flight)
        await self.host.start(self._serve_model)

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.frontend.drain(grace)
        await self.host.stop()
        tracing.shutdown()

    async def cancel_calls(self) -> None:
        await self.frontend.cancel_calls()


class MultiFrontendServer:
    def __init__(self, config: ServerConfig) -> None:
        self.host = EngineHost(config)
        self.frontends = FrontendProcesses(config, self.host)
        self.host.on_change = self.frontends.status_changed
        self.port = self.frontends.port

    async def start(self) -> None:
        frontends = self.frontends
        self.host.serve_metrics(lambda: frontends.in_flight[0], frontends.metrics_dir)
        # Models load at once, each in its own worker processes, while the front ends start.
        await all_or_none([self.host.start(lambda config, core: None), frontends.start()])

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.frontends.drain(grace)
        await self.host.stop()
        await self.frontends.stop()

    async def cancel_calls(self) -> None:
        await self.frontends.cancel_calls()


def fork_worker_zygote(config: ServerConfig) -> None:
    """Forks the zygote of the CPU workers and front ends from this process, before it starts a thread, where their
    environment lets it (executor/zygote.py, fork_here); else the first of them to start starts one plain."""
    cpu = [model for model in config.models if model.device == "cpu"]
    if not cpu and config.num_frontends < 2:
        return
    try:
        env = cpu_process_environment((cpu or list(config.models))[0].cpu_allocator)
    except ConfigError:  # said where the workers start
        return
    if zygote.fork_here(env):
        logger.debug("forked the worker zygote from the server")


def build_server(config: ServerConfig) -> OneProcessServer | MultiFrontendServer:
    return MultiFrontendServer(config) if config.num_frontends > 1 else OneProcessServer(config)


async def run(config: ServerConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains (a second signal cuts the drain short)."""
    server = build_server(config)
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        starting = asyncio.create_task(server.start())
        first_signal = asyncio.create_task(signals.get())
        await asyncio.wait((starting, first_signal), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done() and not server.host.started:
            # No call can be in flight yet: stop loading and exit rather than finish a long load first.
            logger.info("%s while loading: stopping", signal.Signals(first_signal.result()).name)
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        else:
            if starting.done():
                starting.result()  # a start-up error ends here (exit 2)
                freeze_start_up_objects()
            else:
                # The models are up and a front end serves while another still starts (--frontends N): calls
                # may be in flight, so they drain as usual; the front ends still starting are not waited for.
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            logger.info(
                "%s: draining; refusing new calls, up to %.0f s for those in flight (signal again to cancel them)",
                signal.Signals(await first_signal).name,
                config.drain_timeout,
            )
    finally:
        first_signal.cancel()
        drain = asyncio.create_task(server.stop(config.drain_timeout))
        second = asyncio.create_task(signals.get())
        await asyncio.wait((drain, second), return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            logger.warning("second signal: cancelling the calls still running")
            await server.cancel_calls()
        second.cancel()
        await drain
    logger.info("stopped")
