"""The prefill-only work of an Engine (embed, rerank, classify): one FIFO queue shared by its workers.

Each worker's loop (step_loop.py) takes the queue's next batch when it has room (fewer than
`pipeline_depth` steps in flight), so the least busy worker gets the work. With a depth of 2 a worker
already holds batch k+1, packed on its device, while batch k runs.

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
from embedserv.engine.core.step_source import LoopView
from embedserv.engine.ports import SequenceOutput
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.logs import REQUEST_ID
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind, StepBatch, StepOutput
from embedserv.types import EmbedOutput

logger = logging.getLogger(__name__)

# A batch's log line names at most this many of the calls it carried.
_LOGGED_CALLS = 8
# A sequence runs at most this many times: its first try, and one retry after its worker died.
MAX_ATTEMPTS = 2


class PrefillQueue:
    """A StepSource (step_source.py) shared by every worker's loop."""

    one_step_at_a_time = False

    def __init__(
        self, name: str, workers: list[Worker], max_batch_tokens: int, max_batch_requests: int, output: OutputKind
    ) -> None:
        self.name = name
        self.workers = workers
        self.output = output
        self.scheduler = PrefillOnlyScheduler(max_batch_tokens, max_batch_requests)
        # False until the engine starts, and again once it stops or a worker loop crashed.
        self.accepting = False
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[Request, asyncio.Future]] = {}
        # The workers' step loops: woken whenever there is new work.
        self._loops: list[LoopView] = []

    def add_loop(self, loop: LoopView) -> None:
        self._loops.append(loop)

    def loop_started(self) -> None:
        return None

    def loop_stopped(self) -> None:
        """Nothing to do per loop: the engine fails what is queued once every loop has stopped."""
        return None

    def _wake(self) -> None:
        for loop in self._loops:
            loop.wake()

    def new_request(
        self, token_ids: list[int], pool_start: int = 0, token_type_ids=None, encoder_token_ids: list[int] | None = None,
        outputs: tuple[EmbedOutput, ...] = (), adapter: int = -1, pixels=None, image_grid: tuple[int, ...] = (),
    ) -> Request:
        return Request(
            next(self._ids), token_ids, self.output, pool_start=pool_start, token_type_ids=token_type_ids,
            encoder_token_ids=encoder_token_ids or [], call_id=REQUEST_ID.get(),
            outputs=() if outputs == (EmbedOutput.DENSE,) else outputs, adapter=adapter, pixels=pixels,
            image_grid=image_grid,
        )

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_dropped(self) -> int:
        return self.scheduler.num_dropped

    def workers_changed(self) -> None:
        """A worker became ready or died: with none alive, fail what is queued (what is on a worker ends with
        its batch)."""
        if not any(worker.ready for worker in self.workers):
            error = NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
            for request in self.scheduler.drain():
                self._fail_request(request.request_id, error)

    async def run(self, requests: list[Request]) -> list[SequenceOutput]:
        """Each request's output, in order."""
        if not self.accepting:
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
        self._wake()
        try:
            return await asyncio.gather(*futures)
        except BaseException:
            # The caller went away (or a sequence failed): drop what has not run yet.
            for request, future in zip(requests, futures):
                self.scheduler.cancel(request)
                self._waiting.pop(request.request_id, None)
                future.cancel()
            raise

    def schedule(self, loop: LoopView) -> StepBatch | None:
        """The next batch for `loop`'s worker, or None while a less busy ready worker can take it (that
        worker's loop was woken too): the least busy worker gets the work."""
        if any(other.worker.ready and other.in_flight < loop.in_flight for other in self._loops):
            return None
        batch = self.scheduler.schedule()
        if batch is not None and self.scheduler.num_waiting:
            # Loops that declined the batch before this one took it look again.
            self._wake()
        return batch

    def fail_all(self, error: Exception) -> None:
        self.accepting = False
        for request, future in self._waiting.values():
            self.scheduler.cancel(request)
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()

    async def step_done(self, batch: StepBatch, output: StepOutput, worker: Worker, started: float) -> None:
        finished = time.perf_counter()
        self._observe(batch, worker, finished - started)
        rows = dict(zip(output.row_request_ids, output.rows))
        sparse = output.sparse.split() if output.sparse is not None else {}
        vectors = output.vectors.split() if output.vectors is not None else {}
        num_sequences, num_tokens = batch.num_sequences, batch.num_tokens
        for seq in batch.sequences:
            _, future = self._waiting.pop(seq.request_id, (None, None))
            if future is not None and not future.done():
                own_vectors = vectors.get(seq.request_id)
                future.set_result(SequenceOutput(
                    rows.get(seq.request_id), started, finished, sparse.get(seq.request_id),
                    own_vectors[0] if own_vectors is not None else None, num_sequences, num_tokens,
                ))

    def step_failed(self, batch: StepBatch, exc: Exception) -> None:
        logger.error("batch of %d sequences failed on %s", batch.num_sequences, self.name, exc_info=exc)
        for seq in batch.sequences:
            self._fail_request(seq.request_id, RuntimeError(f"inference failed: {exc}"))

    def worker_died(self, batch: StepBatch, died: WorkerDied) -> None:
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
            self._wake()

    def _observe(self, batch: StepBatch, worker: Worker, seconds: float) -> None:
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

    def _fail_request(self, request_id: int, error: Exception) -> None:
        _, future = self._waiting.pop(request_id, (None, None))
        if future is not None and not future.done():
            future.set_exception(error)
