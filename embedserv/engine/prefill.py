"""The prefill-only side of an Engine (embed, rerank, classify): batches from the scheduler to the workers.

One dispatcher task waits until some worker can take a batch (it is ready and has fewer than
`pipeline_depth` batches in flight), pops the next batch and sends it to the least busy such worker.
With a depth of 2 a worker already holds batch k+1, packed on its device, while batch k runs.

When a worker dies, the sequences of its batches go back to the front of the queue for one more try if
another worker is alive; otherwise they fail with NotReady (UNAVAILABLE). While no worker is alive,
calls fail at once instead of queueing for a restart that may not come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from embedserv import metrics
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.logs import REQUEST_ID
from embedserv.scheduler.outputs import SchedulerOutput
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, PrefillRequest

logger = logging.getLogger(__name__)

# A batch's log line names at most this many of the calls it carried.
_LOGGED_CALLS = 8
# A sequence runs at most this many times: its first try, and one retry after its worker died.
MAX_ATTEMPTS = 2


class PrefillLoop:
    def __init__(self, name: str, workers: list[Worker], max_batch_tokens: int, max_batch_requests: int,
                 pipeline_depth: int) -> None:
        self.name = name
        self.workers = workers
        self.pipeline_depth = pipeline_depth
        self.scheduler = PrefillOnlyScheduler(max_batch_tokens, max_batch_requests)
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[PrefillRequest, asyncio.Future]] = {}
        self._in_flight = {worker.index: 0 for worker in workers}
        self._batches: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._dispatcher is not None and not self._dispatcher.done()

    def new_request(self, token_ids, pool_start: int = 0, token_type_ids=None) -> PrefillRequest:
        return PrefillRequest(
            next(self._ids), token_ids, pool_start=pool_start, token_type_ids=token_type_ids, call_id=REQUEST_ID.get()
        )

    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"dispatch-{self.name}")
        self._dispatcher.add_done_callback(self._on_dispatcher_exit)

    async def stop(self) -> None:
        tasks = [t for t in (self._dispatcher, *self._batches) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all(NotReady(f"model {self.name} is shutting down; retry on another replica"))

    def workers_changed(self) -> None:
        """A worker became ready or died: wake the dispatcher; with none alive, fail what is queued (what is
        on a worker ends with its batch)."""
        self._changed.set()
        if not any(worker.ready for worker in self.workers):
            error = NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
            for request in self.scheduler.drain():
                self._fail_request(request.request_id, error)

    async def run(self, requests: list[PrefillRequest]) -> list[tuple]:
        """(row, started, finished) per request, in order."""
        if not self.is_running:
            raise NotReady(f"model {self.name} is not running; retry shortly")
        if not any(worker.ready for worker in self.workers):
            raise NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            future = loop.create_future()
            self._waiting[request.request_id] = (request, future)
            self.scheduler.add(request)
            futures.append(future)
        self._changed.set()
        try:
            return await asyncio.gather(*futures)
        except BaseException:
            # The caller went away (or a sequence failed): drop what has not run yet.
            for request, future in zip(requests, futures):
                request.cancelled = True
                self._waiting.pop(request.request_id, None)
                future.cancel()
            raise

    def _on_dispatcher_exit(self, task: asyncio.Task) -> None:
        """A crashed dispatcher must not leave callers waiting forever: fail what is pending."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("dispatcher of %s died", self.name, exc_info=task.exception())
        self._fail_all(NotReady(f"model {self.name} stopped after an internal error; retry later"))

    def _fail_all(self, error: Exception) -> None:
        for request, future in self._waiting.values():
            request.cancelled = True
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()

    def _free_worker(self) -> Worker | None:
        free = [w for w in self.workers if w.ready and self._in_flight[w.index] < self.pipeline_depth]
        return min(free, key=lambda w: self._in_flight[w.index], default=None)

    async def _dispatch(self) -> None:
        while True:
            batch = self.scheduler.schedule() if self._free_worker() is not None else None
            if batch is None:
                # Nothing can change between the check and the clear: no await in between.
                self._changed.clear()
                await self._changed.wait()
                continue
            worker = self._free_worker()
            self._in_flight[worker.index] += 1
            task = asyncio.create_task(self._run_batch(worker, batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run_batch(self, worker: Worker, batch: SchedulerOutput) -> None:
        started = time.perf_counter()
        try:
            output = await worker.run_prefill(batch)
        except WorkerDied as died:
            self._retry_or_fail(batch, died)
            return
        except Exception as exc:
            logger.exception("batch of %d sequences failed on %s", batch.num_sequences, self.name)
            self._fail(batch, RuntimeError(f"inference failed: {exc}"))
            return
        finally:
            self._in_flight[worker.index] -= 1
            self._changed.set()
        finished = time.perf_counter()
        self._observe(batch, worker, finished - started)
        for request_id, row in zip(output.request_ids, output.rows):
            _, future = self._waiting.pop(request_id, (None, None))
            if future is not None and not future.done():
                future.set_result((row, started, finished))

    def _observe(self, batch: SchedulerOutput, worker: Worker, seconds: float) -> None:
        metrics.BATCH_SEQUENCES.labels(self.name, "prefill").observe(batch.num_sequences)
        metrics.BATCH_TOKENS.labels(self.name, "prefill").observe(batch.num_tokens)
        if logger.isEnabledFor(logging.INFO):
            calls = {self._waiting[s.request_id][0].call_id for s in batch.sequences if s.request_id in self._waiting}
            calls.discard("")  # library calls have no id
            shown = sorted(calls)[:_LOGGED_CALLS]
            more = f" +{len(calls) - len(shown)} more" if len(calls) > len(shown) else ""
            logger.info(
                "%s: batch of %d sequences, %d tokens on worker %d in %.1f ms; calls %s%s",
                self.name, batch.num_sequences, batch.num_tokens, worker.index, seconds * 1e3, " ".join(shown), more,
            )

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_dropped(self) -> int:
        return self.scheduler.num_dropped

    def _retry_or_fail(self, batch: SchedulerOutput, died: WorkerDied) -> None:
        alive = any(worker.ready for worker in self.workers)
        retry = []
        for seq in batch.sequences:
            request, future = self._waiting.get(seq.request_id, (None, None))
            if request is None or future.done():
                continue
            if died.sent:
                request.attempts += 1
            if alive and request.attempts < MAX_ATTEMPTS:
                retry.append(request)
            else:
                self._fail_request(seq.request_id, NotReady(f"{died}; retry the call"))
        if retry:
            logger.warning("%s: retrying %d sequences after: %s", self.name, len(retry), died)
            self.scheduler.requeue(retry)

    def _fail(self, batch: SchedulerOutput, error: Exception) -> None:
        for seq in batch.sequences:
            self._fail_request(seq.request_id, error)

    def _fail_request(self, request_id: int, error: Exception) -> None:
        _, future = self._waiting.pop(request_id, (None, None))
        if future is not None and not future.done():
            future.set_exception(error)
