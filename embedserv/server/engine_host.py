"""The engine role: every served model's LocalCore (its workers, queues and dispatcher), whether each serves, and
/metrics.

Models load at once, each in its own worker processes (or, for tests, on a model thread of this process);
the first that cannot start stops the others. The front end that answers calls (a FrontendServer in this
process, or the front-end processes over the link, server/frontends.py) gets each model as it is ready and
hears whenever the host's status changes: a model's serving flips, or every model has started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from embedserv.config import ModelConfig, ServerConfig
from embedserv.engine.core.local_core import LocalCore
from embedserv.engine.core.workers import worker_processes
from embedserv.engine.ports import CoreStatus
from embedserv.executor.process_worker import ProcessWorker
from embedserv.server.metrics_endpoint import MetricsServer

logger = logging.getLogger(__name__)


async def all_or_none(coroutines: list[Coroutine]) -> None:
    """Runs the coroutines at once; the first to fail cancels the others, and its error is raised."""
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass(frozen=True)
class HostStatus:
    # Every model loaded and started (the server's own health turns SERVING with it).
    started: bool
    # Each model's status, in --model order (a model still loading: not running, not serving).
    models: dict[str, CoreStatus]


class EngineHost:
    def __init__(self, config: ServerConfig, worker_processes: bool = True) -> None:
        """`worker_processes` False runs each model on a model thread of this process (LocalCore.load, one
        replica): the tests' in-process servers, which then pay no worker process start."""
        self.config = config
        self.worker_processes = worker_processes
        self.cores: dict[str, LocalCore] = {}
        self._names = [model.served_name for model in config.models]
        self.started = False
        self.metrics: MetricsServer | None = None
        # Called with no arguments whenever status() may have changed.
        self.on_change: Callable[[], None] = lambda: None
        # The cores whose workers are starting, so that a stop during start-up ends them too.
        self._loading: list[LocalCore] = []

    def status(self) -> HostStatus:
        cores = self.cores
        models = {name: cores[name].status() if name in cores else CoreStatus() for name in self._names}
        return HostStatus(self.started, models)

    def serving_cores(self) -> list[LocalCore]:
        """The cores started so far, in --model order."""
        return [self.cores[name] for name in self._names if name in self.cores]

    def serve_metrics(self, in_flight: Callable[[], int], frontends_dir: str | None = None) -> None:
        """/metrics on --metrics-port (if set): the cores' counts and `in_flight()`, the inputs admitted now;
        with `frontends_dir`, the front-end processes' counters too."""
        if self.config.metrics_port is not None:
            self.metrics = MetricsServer(
                self.config.host, self.config.metrics_port, self.serving_cores, in_flight, frontends_dir
            )

    async def start(self, on_ready: Callable[[ModelConfig, LocalCore], None]) -> None:
        """Loads and starts every model, calling `on_ready(config, core)` as each is ready to serve."""
        await all_or_none([self._start_model(m, on_ready) for m in self.config.models])
        self.started = True
        self.on_change()
        logger.info("serving %s", ", ".join(self._names))

    async def _start_model(self, config: ModelConfig, on_ready: Callable[[ModelConfig, LocalCore], None]) -> None:
        workers: list[ProcessWorker] = []
        if self.worker_processes:
            # Launched first: the processes import torch and load the weights while this one reads the model.
            workers = worker_processes(config)
            for worker in workers:
                worker.launch()
        try:
            core = await asyncio.get_running_loop().run_in_executor(None, self._load, config, workers)
        except BaseException:
            await asyncio.gather(*(worker.stop() for worker in workers), return_exceptions=True)
            raise
        # Until it serves, stop() finds it here (a signal or another model's failure during start-up).
        self._loading.append(core)
        await core.start()
        self._loading.remove(core)
        self.cores[config.served_name] = core
        core.on_serving_change = lambda serving: self.on_change()
        on_ready(config, core)
        self.on_change()

    def _load(self, config: ModelConfig, workers: list[ProcessWorker]) -> LocalCore:
        threads = self.config.tokenizer_threads
        if self.worker_processes:
            return LocalCore.with_worker_processes(config, threads, workers)
        return LocalCore.load(config, threads, warm_up=config.warm_up)

    async def stop(self) -> None:
        for core in [*self.cores.values(), *self._loading]:
            await core.stop()
        if self.metrics is not None:
            self.metrics.stop()
