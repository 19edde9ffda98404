"""One dispatch loop per worker: every step a worker runs, prefill-only batches and generation steps alike.

The loop takes work when its worker is ready and has room (fewer than `pipeline_depth` steps in flight),
from the first of its step sources (step_source.py) that has some: the engine gives a worker's loop its
generation streams first, then the model's shared prefill queue. A source that runs one step at a time
(generation: a step is scheduled only after the previous one's tokens are in) is skipped while its step
is in flight. Each step goes through `worker.execute(StepBatch) -> StepOutput`; its source then resolves
what waited on it. The sources share the worker and its device; none knows the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from embedserv.engine.core.step_source import StepSource
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.scheduler.load import BusyWindow
from embedserv.steps import StepBatch

logger = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(self, name: str, worker: Worker, sources: Sequence[StepSource], pipeline_depth: int) -> None:
        """`sources` in priority order: the loop takes its next step from the first one that has one."""
        self.name = name
        self.worker = worker
        self.sources = tuple(sources)
        self.pipeline_depth = pipeline_depth
        self._in_flight = 0
        # The one-step-at-a-time sources with a step in flight.
        self._stepping: set[StepSource] = set()
        self._changed = asyncio.Event()
        self._steps: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        # While any step is in flight the worker counts as busy (the busy-ratio metric).
        self.busy = BusyWindow()
        for source in self.sources:
            source.add_loop(self)

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
        for source in self.sources:
            source.loop_started()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in self.sources:
            source.loop_stopped()

    def _on_exit(self, task: asyncio.Task) -> None:
        """A crashed loop must not leave callers waiting forever: fail what waits on it."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("step loop of %s worker %d died", self.name, self.worker.index, exc_info=task.exception())
        error = NotReady(f"model {self.name} stopped after an internal error; retry later")
        for source in self.sources:
            source.fail_all(error)
            source.loop_stopped()

    def _next(self) -> tuple[StepBatch, StepSource] | None:
        if not self.worker.ready or self._in_flight >= self.pipeline_depth:
            return None
        for source in self.sources:
            if source in self._stepping:
                continue
            batch = source.schedule(self)
            if batch is not None:
                return batch, source
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
            self.busy.begin()
            if source.one_step_at_a_time:
                self._stepping.add(source)
            task = asyncio.create_task(self._step(batch, source))
            self._steps.add(task)
            task.add_done_callback(self._steps.discard)

    async def _step(self, batch: StepBatch, source: StepSource) -> None:
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
            if not self._in_flight:
                self.busy.end()
            self._stepping.discard(source)
            self._changed.set()
