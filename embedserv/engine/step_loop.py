"""One dispatch loop per worker: every step a worker runs, prefill-only batches and generation steps alike.

The loop takes work when its worker is ready and has room (fewer than `pipeline_depth` steps in flight):
first the next generation step of this worker's streams (one at a time: a step is scheduled only after
the previous one's tokens are in), then the next batch of the engine's shared prefill queue. Each step
goes through `worker.execute(StepBatch) -> StepOutput`; its source (PrefillQueue or GenerationStreams)
then resolves what waited on it. Both sources share the worker and its device; neither knows the other.
"""

from __future__ import annotations

import asyncio
import logging
import time

from embedserv.engine.generation import GenerationStreams
from embedserv.engine.prefill import PrefillQueue
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.types import FinishReason, StepBatch

logger = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(
        self, name: str, worker: Worker, prefill: PrefillQueue | None, generation: GenerationStreams | None,
        pipeline_depth: int,
    ) -> None:
        self.name = name
        self.worker = worker
        self.prefill = prefill
        self.generation = generation
        self.pipeline_depth = pipeline_depth
        self._in_flight = 0
        self._generating = False
        self._changed = asyncio.Event()
        self._steps: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        if prefill is not None:
            prefill.add_loop(self)
        if generation is not None:
            generation.add_listener(self.wake)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wake(self) -> None:
        self._changed.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"steps-{self.name}/{self.worker.index}")
        self._task.add_done_callback(self._on_exit)
        if self.generation is not None:
            self.generation.running = True
            self.generation.follow_worker()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.generation is not None:
            self.generation.running = False
            self.generation.end_all(FinishReason.CANCELLED)

    def _on_exit(self, task: asyncio.Task) -> None:
        """A crashed loop must not leave callers waiting forever: fail what waits on it."""
        if self.generation is not None:
            self.generation.running = False
        if task.cancelled() or task.exception() is None:
            return
        logger.error("step loop of %s worker %d died", self.name, self.worker.index, exc_info=task.exception())
        error = NotReady(f"model {self.name} stopped after an internal error; retry later")
        if self.prefill is not None:
            self.prefill.fail_all(error)
        if self.generation is not None:
            self.generation.fail_all(error)

    def _next(self) -> tuple[StepBatch, PrefillQueue | GenerationStreams] | None:
        if not self.worker.ready or self._in_flight >= self.pipeline_depth:
            return None
        if self.generation is not None and not self._generating:
            batch = self.generation.schedule()
            if batch is not None:
                return batch, self.generation
        if self.prefill is not None:
            batch = self.prefill.schedule(self)
            if batch is not None:
                return batch, self.prefill
        return None

    async def _run(self) -> None:
        while True:
            work = self._next()
            if work is None:
                # Nothing can change between the check and the clear: no await in between.
                self._changed.clear()
                await self._changed.wait()
                continue
            batch, source = work
            self._in_flight += 1
            self._generating |= source is self.generation
            task = asyncio.create_task(self._step(batch, source))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)

    async def _step(self, batch: StepBatch, source: PrefillQueue | GenerationStreams) -> None:
        started = time.perf_counter()
        try:
            output = await self.worker.execute(batch)
            await source.step_done(batch, output, self.worker, started)
        except WorkerDied as died:
            source.worker_died(batch, died)
        except Exception as exc:
            source.step_failed(batch, exc)
        finally:
            self._in_flight -= 1
            if source is self.generation:
                self._generating = False
            self._changed.set()
