"""The in-process worker: the replica on one model thread of this process (library use and most tests).

It never dies; a batch that raises fails only its own requests.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

from embedserv.engine.loading import Replica
from embedserv.engine.types import SamplingParams
from embedserv.executor.base import WorkerStats
from embedserv.scheduler.generation import GenerationBatch
from embedserv.scheduler.outputs import SchedulerOutput
from embedserv.worker.model_runner import ModelRunnerOutput


class LocalWorker:
    index = 0
    incarnation = 1

    def __init__(self, replica: Replica, model_thread: ThreadPoolExecutor) -> None:
        self.replica = replica
        self.num_kv_blocks = replica.num_kv_blocks
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

    async def run_prefill(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        return await self._on_model_thread(self.replica.prefill.execute, batch)

    async def run_generation(self, batch: GenerationBatch, sampling: Mapping[int, SamplingParams]) -> dict[int, int]:
        return await self._on_model_thread(self.replica.generation.execute, batch, sampling)

    async def _on_model_thread(self, fn, *args):
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)
        finally:
            self._batches += 1
            self._busy_seconds += time.perf_counter() - started
