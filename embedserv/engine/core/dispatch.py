"""The steps an engine core's workers run: which worker runs which (the Dispatcher, one per core, on the event
loop). The prefill queue they share is prefill_work.py's PrefillWork.

Work comes from step sources: a worker's own generation streams (generation.py: they live in its KV cache) and
the shared prefill queue. Whenever something changes (work arrives, a step ends, a worker comes or goes) the
dispatcher places what it can: each ready worker with room (fewer than `pipeline_depth` steps in flight) takes
its generation step first (one at a time: a step's sampled tokens are the next one's input), then prefill
batches go to the ready worker with the fewest steps in flight. A step's source resolves what waited on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.steps import StepBatch, StepOutput

logger = logging.getLogger(__name__)

# The busy ratio's sliding window (seconds): long enough to smooth single batches, short enough to follow
# a burst within one autoscaler period.
BUSY_WINDOW_S = 10.0


@dataclass(frozen=True, eq=False)
class Step:
    """A scheduled step and what its source needs back with its result (prefill: the requests it carries)."""

    batch: StepBatch
    requests: tuple[Any, ...] = ()
    # Prefill: the tokens the step computes (the batch metrics' and the trace's sizes).
    num_tokens: int = 0
    # A generation step continues the worker's running batch (sent as a delta against it).
    generation: bool = False


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


# The least busy of several slots: the one with the fewest steps in flight.
_IN_FLIGHT = attrgetter("in_flight")


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
        self,
        name: str,
        workers: list[Worker],
        prefill: StepSource | None,
        streams: list[StepSource],
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
        for source in [slot.streams for slot in self._slots] + [self.prefill]:
            if source is not None:
                source.fail_all(error)

    async def _run(self) -> None:
        while True:
            if not self._place():
                # Nothing can change between the check and the clear: no await in between.
                self._changed.clear()
                await self._changed.wait()

    def _place(self) -> bool:
        """Starts every step that can start now; whether it started any."""
        placed, depth = False, self.pipeline_depth
        for slot in self._slots:
            if slot.streams is not None and not slot.stepping and slot.worker.ready and slot.in_flight < depth:
                step = slot.streams.schedule()
                if step is not None:
                    self._launch(slot, step, slot.streams)
                    placed = True
        while self.prefill is not None:
            free = [
                slot
                for slot in self._slots
                if slot.worker.ready and not slot.worker.recycling and slot.in_flight < depth
            ]
            if not free:
                break
            step = self.prefill.schedule()
            if step is None:
                break
            self._launch(min(free, key=_IN_FLIGHT), step, self.prefill)
            placed = True
        return placed

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
            output = await slot.worker.execute(step.batch, step.generation)
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


class BusyWindow:
    """The share of the last `window_s` seconds during which a worker had a step in flight (the time since it was
    made, until `window_s` has passed). begin() and end() bracket each busy period (the first step sent, the last
    one answered); ratio() adds up the busy time within the window, the open period included, so a step that runs
    for a minute reads busy throughout. Periods that end within `window_s / 100` of the start of the last record
    join it, so thousands of short steps keep about a hundred records; the one record the window's start cuts
    through counts pro rata (at most 1% of the window off)."""

    def __init__(self, window_s: float = BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._grain = window_s / 100
        self._clock = clock
        self._created = clock()
        # (first start, last end, busy seconds) of the periods that may still overlap the window; oldest first.
        self._records: deque[tuple[float, float, float]] = deque()
        self._since: float | None = None

    def begin(self) -> None:
        if self._since is None:
            self._since = self._clock()

    def end(self) -> None:
        if self._since is None:
            return
        now, since = self._clock(), self._since
        self._since = None
        last = self._records[-1] if self._records else None
        if last is not None and now - last[0] < self._grain:
            self._records[-1] = (last[0], now, last[2] + now - since)
        else:
            self._records.append((since, now, now - since))
        horizon = now - self.window_s
        while self._records and self._records[0][1] <= horizon:
            self._records.popleft()

    def ratio(self) -> float:
        now = self._clock()
        start = max(now - self.window_s, self._created)
        if now <= start:
            return 0.0
        # Snapshots: the loop may add or end a period meanwhile.
        records, since = tuple(self._records), self._since
        busy = 0.0
        for first, last, seconds in records:
            if last <= start:
                continue
            busy += seconds if first >= start else seconds * (last - start) / (last - first)
        if since is not None:
            busy += now - max(since, start)
        return min(1.0, max(0.0, busy / (now - start)))
