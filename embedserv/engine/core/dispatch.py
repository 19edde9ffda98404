"""The steps an engine core's workers run: which worker runs which (the Dispatcher, one per core, on the event
loop), and the prefill queue they share (PrefillWork).

Work comes from step sources: a worker's own generation streams (generation.py: they live in its KV cache) and
the shared prefill queue. Whenever something changes (work arrives, a step ends, a worker comes or goes) the
dispatcher places what it can: each ready worker with room (fewer than `pipeline_depth` steps in flight) takes
its generation step first (one at a time: a step's sampled tokens are the next one's input), then prefill
batches go to the ready worker with the fewest steps in flight. A step's source resolves what waited on it.

Prefill: a call's sequences become Requests that carry the call's futures; a request is in the FIFO queue or in
a step on a worker, never in a table. When a worker dies, its steps' sequences go back to the front of the
queue for one more try if another worker is alive, else fail with NotReady (UNAVAILABLE); while none is
alive, calls fail at once instead of queueing for a restart that may not come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from embedserv import metrics
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import SequenceOutput
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.logs import REQUEST_ID
from embedserv.models.loading.tasks import TaskSpec
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, batch_of
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind, StepBatch, StepOutput
from embedserv.types import EmbedOutput

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
            free = [slot for slot in self._slots if slot.worker.ready and slot.in_flight < depth]
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


# A batch's log line names at most this many of the calls it carried.
_LOGGED_CALLS = 8
# A sequence runs at most this many times: its first try, and one retry after its worker died.
MAX_ATTEMPTS = 2


class PrefillWork:
    """The model's prefill queue: a StepSource of every worker."""

    one_step_at_a_time = False

    def __init__(
        self,
        name: str,
        workers: list[Worker],
        max_batch_tokens: int,
        max_batch_requests: int,
        output: OutputKind,
        wake: Callable[[], None],
        task: TaskSpec | None = None,
    ) -> None:
        """`wake`: the dispatcher's, called when there is new work. `task`: the model's (an encoder-decoder's
        sequences are its encoder's input)."""
        self.name = name
        self.workers = workers
        self.output = output
        self.decoder_start = task.decoder_start_token_id if task is not None else None
        self.decoder_reads_start_only = task is not None and task.prefill_decoder_input == "start"
        self.scheduler = PrefillOnlyScheduler(max_batch_tokens, max_batch_requests)
        # False until the engine starts, and again once it stops or its dispatcher crashed.
        self.accepting = False
        self._wake = wake
        self._ids = itertools.count()
        # The steps on workers now (what fail_all fails besides the queue).
        self._running: set[Step] = set()

    def new_request(self, sequence: InputSequence, wanted: tuple[EmbedOutput, ...] = ()) -> Request:
        """The request that computes one of a call's sequences (its outputs `wanted`)."""
        if self.decoder_start is not None:
            # Encoder-decoder: the text is the encoder's input; the decoder reads its start token (a yes/no
            # reranker's first step) or the input shifted right behind it (BART's classifier).
            start, ids = self.decoder_start, sequence.ids
            decoder = [start] if self.decoder_reads_start_only else [start, *ids[:-1]]
            return Request(next(self._ids), decoder, self.output, encoder_token_ids=ids, call_id=REQUEST_ID.get())
        return Request(
            next(self._ids),
            sequence.ids,
            self.output,
            pool_start=sequence.pool_start,
            token_type_ids=sequence.token_type_ids,
            call_id=REQUEST_ID.get(),
            outputs=() if wanted == (EmbedOutput.DENSE,) else wanted,
            adapter=sequence.adapter,
            pixels=sequence.pixels,
            image_grid=sequence.image_grid,
        )

    def workers_changed(self) -> None:
        """A worker became ready or died: with none alive, fail what is queued (what is on a worker ends with
        its step)."""
        if not any(worker.ready for worker in self.workers):
            error = NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
            for request in self.scheduler.drain():
                _fail(request, error)

    async def run(self, requests: list[Request]) -> list[SequenceOutput]:
        """Each request's output, in order."""
        if not self.accepting:
            raise NotReady(f"model {self.name} is not running; retry shortly")
        if not any(worker.ready for worker in self.workers):
            raise NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
        loop = asyncio.get_running_loop()
        for request in requests:
            request.future = loop.create_future()
            self.scheduler.add(request)
        self._wake()
        try:
            return await asyncio.gather(*(request.future for request in requests))
        except BaseException:
            # The caller went away (or a sequence failed): drop what has not run yet.
            for request in requests:
                self.scheduler.cancel(request)
                request.future.cancel()
            raise

    def schedule(self) -> Step | None:
        requests = self.scheduler.pick()
        if not requests:
            return None
        step = Step(batch_of(requests), tuple(requests), sum(len(r.prompt_token_ids) for r in requests))
        self._running.add(step)
        return step

    def fail_all(self, error: Exception) -> None:
        self.accepting = False
        for request in self.scheduler.drain():
            _fail(request, error)
        for step in self._running:
            for request in step.requests:
                _fail(request, error)
        self._running.clear()

    async def step_done(self, step: Step, output: StepOutput, worker: Worker, started: float) -> None:
        finished = time.perf_counter()
        self._running.discard(step)
        num_sequences, num_tokens = len(step.requests), step.num_tokens
        metrics.BATCH_SEQUENCES.labels(self.name, "prefill").observe(num_sequences)
        metrics.BATCH_TOKENS.labels(self.name, "prefill").observe(num_tokens)
        if logger.isEnabledFor(logging.INFO):
            self._log(step, worker, finished - started)
        if len(output.rows) != len(output.row_request_ids):
            # Raised here, the step fails its calls (a malformed answer never reaches them).
            raise ValueError(f"the worker gave {len(output.rows)} rows for {len(output.row_request_ids)} sequences")
        rows = dict(zip(output.row_request_ids, output.rows, strict=True))
        sparse = output.sparse.split() if output.sparse is not None else {}
        vectors = output.vectors.split() if output.vectors is not None else {}
        for request in step.requests:
            if request.future.done():
                continue
            request_id = request.request_id
            own_vectors = vectors.get(request_id)
            request.future.set_result(
                SequenceOutput(
                    rows.get(request_id),
                    started,
                    finished,
                    sparse.get(request_id),
                    own_vectors[0] if own_vectors is not None else None,
                    num_sequences,
                    num_tokens,
                )
            )

    def step_failed(self, step: Step, exc: Exception) -> None:
        self._running.discard(step)
        logger.error("batch of %d sequences failed on %s", len(step.requests), self.name, exc_info=exc)
        for request in step.requests:
            _fail(request, RuntimeError(f"inference failed: {exc}"))

    def worker_died(self, step: Step, died: WorkerDied) -> None:
        self._running.discard(step)
        alive = any(worker.ready for worker in self.workers)
        retry = []
        for request in step.requests:
            if request.future.done():
                continue
            if died.sent:
                request.attempts += 1
            if alive and request.attempts < MAX_ATTEMPTS:
                retry.append(request)
            else:
                _fail(request, NotReady(f"{died}; retry the call"))
        if retry:
            logger.warning("%s: retrying %d sequences after: %s", self.name, len(retry), died)
            self.scheduler.requeue(retry)
            self._wake()

    def _log(self, step: Step, worker: Worker, seconds: float) -> None:
        calls = {request.call_id for request in step.requests if not request.future.done()}
        calls.discard("")  # library calls have no id
        shown = sorted(calls)[:_LOGGED_CALLS]
        more = f" +{len(calls) - len(shown)} more" if len(calls) > len(shown) else ""
        logger.info(
            "%s: batch of %d sequences, %d tokens on worker %d in %.1f ms; calls %s%s",
            self.name,
            len(step.requests),
            step.num_tokens,
            worker.index,
            seconds * 1e3,
            " ".join(shown),
            more,
        )


def _fail(request: Request, error: Exception) -> None:
    if request.future is not None and not request.future.done():
        request.future.set_exception(error)


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
