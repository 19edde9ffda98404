"""The in-process worker: the replica on one model thread of this process (library use and most tests).

It never dies; a batch that raises fails only its own requests.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

from embedserv.executor.base import WorkerStats
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.types import StepBatch, StepOutput
from embedserv.worker.model_runner import ModelRunner


class LocalWorker:
    index = 0
    incarnation = 1

    def __init__(self, runner: ModelRunner, model_thread: ThreadPoolExecutor) -> None:
        self.runner = runner
        self.kv_cache: KvCacheLayout | None = runner.kv_cache_layout()
        # Never called: this worker is always ready.
        self.on_change = lambda: None
        self._model_thread = model_thread
        self._batches = 0
        self._busy_seconds = 0.0

    @property
    def ready(self) -> bool:
        return True

    def stats(self) -> WorkerStats:
        return WorkerStats(self.index, os.getpid(), True, 0, self._batches, self._busy_seconds)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._model_thread.shutdown(wait=True)

    async def wait_ready(self) -> None:
        return None

    async def execute(self, batch: StepBatch) -> StepOutput:
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._model_thread, self.runner.execute, batch)
        finally:
            self._batches += 1
            self._busy_seconds += time.perf_counter() - started
