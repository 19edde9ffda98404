"""Which worker runs which step: one dispatcher per engine core, on the event loop.

Work comes from step sources: a worker's own generation streams (generation.py: its streams live in its KV
cache, so only it can run their steps) and the model's shared prefill work (prefill.py). Whenever something
changes (work arrives, a step ends, a worker comes or goes) the dispatcher places what it can: each ready worker
with room (fewer than `pipeline_depth` steps in flight) takes its generation step first, then prefill batches
go to the ready worker with the fewest steps in flight. A source that runs one step at a time (generation: a
step's sampled tokens are the next step's input) gets its next step scheduled only once the last one is done.

Each step runs as `worker.execute(StepBatch) -> StepOutput`, and its source then resolves what waited on it.
A worker's busy share (the load metrics) counts the time it has a step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.scheduler.load import BusyWindow
from embedserv.steps import StepBatch, StepOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Step:
    """A scheduled step and what its source needs back with its result (prefill: the requests it carries)."""

    batch: StepBatch
    requests: tuple[Any, ...] = ()


class StepSource(Protocol):
    # True when a step can only be scheduled once the previous one's results are in.
    one_step_at_a_time: bool

    def schedule(self) -> Step | None:
        """The next step for a ready worker with room, or None: nothing to run now."""
        ...

    async def step_done(self, step: Step, output: StepOutput, worker: Worker, started: float) -> None: ...

    def step_failed(self, step: Step, exc: Exception) -> None: ...

    def worker_died(self, step: Step, died: WorkerDied) -> None: ...

    def fail_all(self, error: Exception) -> None:
        """Fails everything that waits on this source (the dispatcher stopped or crashed)."""
        ...


class _Slot:
    """One worker as the dispatcher sees it."""

    def __init__(self, worker: Worker, streams: StepSource | None) -> None:
        self.worker = worker
        # The worker's own generation streams, stepped before any prefill batch.
        self.streams = streams
        self.in_flight = 0
        # A one-step-at-a-time source's step is in flight.
        self.stepping = False
        self.busy = BusyWindow()


class Dispatcher:
    def __init__(
        self, name: str, workers: list[Worker], prefill: StepSource | None, streams: list[StepSource],
        pipeline_depth: int,
    ) -> None:
        """`streams`: each worker's generation streams, in worker order (empty for models that do not generate)."""
        self.name = name
        self.prefill = prefill
        self.pipeline_depth = pipeline_depth
        self._slots = [_Slot(worker, streams[i] if streams else None) for i, worker in enumerate(workers)]
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._steps: set[asyncio.Task] = set()

    @property
    def sources(self) -> list[StepSource]:
        streams = [slot.streams for slot in self._slots if slot.streams is not None]
        return streams + ([self.prefill] if self.prefill is not None else [])

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def busy_ratio(self) -> float:
        """The workers' busy share of the last BUSY_WINDOW_S, averaged (read from the metrics thread)."""
        return sum(slot.busy.ratio() for slot in self._slots) / len(self._slots) if self._slots else 0.0

    def wake(self) -> None:
        """There may be work, or a worker may have come or gone: look again."""
        self._changed.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"dispatch-{self.name}")
        self._task.add_done_callback(self._on_exit)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._steps) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _on_exit(self, task: asyncio.Task) -> None:
        """A crashed dispatcher must not leave callers waiting forever: fail what waits on it."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("the step dispatcher of %s died", self.name, exc_info=task.exception())
        error = NotReady(f"model {self.name} stopped after an internal error; retry later")
        for source in self.sources:
            source.fail_all(error)

    async def _run(self) -> None:
        while True:
            if not self._place():
                # Nothing can change between the check and the clear: no await in between.
                self._changed.clear()
                await self._changed.wait()

    def _place(self) -> bool:
        """Starts every step that can start now; whether it started any."""
        placed = False
        for slot in self._slots:
            if slot.streams is not None and not slot.stepping and self._has_room(slot):
                step = slot.streams.schedule()
                if step is not None:
                    self._launch(slot, step, slot.streams)
                    placed = True
        while self.prefill is not None:
            free = [slot for slot in self._slots if self._has_room(slot)]
            if not free:
                break
            step = self.prefill.schedule()
            if step is None:
                break
            self._launch(min(free, key=lambda slot: slot.in_flight), step, self.prefill)
            placed = True
        return placed

    def _has_room(self, slot: _Slot) -> bool:
        return slot.worker.ready and slot.in_flight < self.pipeline_depth

    def _launch(self, slot: _Slot, step: Step, source: StepSource) -> None:
        slot.in_flight += 1
        slot.busy.begin()
        if source.one_step_at_a_time:
            slot.stepping = True
        task = asyncio.create_task(self._step(slot, step, source))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    async def _step(self, slot: _Slot, step: Step, source: StepSource) -> None:
        started = time.perf_counter()
        try:
            output = await slot.worker.execute(step.batch)
            await source.step_done(step, output, slot.worker, started)
        except WorkerDied as died:
            source.worker_died(step, died)
        except Exception as exc:
            source.step_failed(step, exc)
        finally:
            slot.in_flight -= 1
            if not slot.in_flight:
                slot.busy.end()
            if source.one_step_at_a_time:
                slot.stepping = False
            self._changed.set()
