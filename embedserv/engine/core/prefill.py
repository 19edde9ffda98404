"""The prefill-only work of an engine core (embed, rerank, classify): one FIFO queue its workers share.

A call's sequences become Requests that carry the call's futures; the dispatcher (dispatch.py) gives the
queue's batches to the least busy worker, and each step's result resolves the futures of the requests it
carried. No table of requests: a request is in the scheduler's queue or in a step on a worker.

When a worker dies, the sequences of its steps go back to the front of the queue for one more try if another
worker is alive; otherwise they fail with NotReady (UNAVAILABLE). While no worker is alive, calls fail at once
instead of queueing for a restart that may not come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from embedserv import metrics
from embedserv.engine.core.dispatch import Step
from embedserv.engine.ports import SequenceOutput
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.logs import REQUEST_ID
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, batch_of
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind, StepOutput
from embedserv.types import EmbedOutput

logger = logging.getLogger(__name__)

# A batch's log line names at most this many of the calls it carried.
_LOGGED_CALLS = 8
# A sequence runs at most this many times: its first try, and one retry after its worker died.
MAX_ATTEMPTS = 2


class PrefillWork:
    """A StepSource (dispatch.py) of every worker."""

    one_step_at_a_time = False

    def __init__(
        self, name: str, workers: list[Worker], max_batch_tokens: int, max_batch_requests: int, output: OutputKind,
        wake: Callable[[], None],
    ) -> None:
        """`wake`: the dispatcher's, called when there is new work."""
        self.name = name
        self.workers = workers
        self.output = output
        self.scheduler = PrefillOnlyScheduler(max_batch_tokens, max_batch_requests)
        # False until the engine starts, and again once it stops or its dispatcher crashed.
        self.accepting = False
        self._wake = wake
        self._ids = itertools.count()
        # The steps on workers now (what fail_all fails besides the queue).
        self._running: set[Step] = set()

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
        step = Step(batch_of(requests), tuple(requests))
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
        self._observe(step, worker, finished - started)
        rows = dict(zip(output.row_request_ids, output.rows))
        sparse = output.sparse.split() if output.sparse is not None else {}
        vectors = output.vectors.split() if output.vectors is not None else {}
        batch = step.batch
        for request in step.requests:
            if request.future.done():
                continue
            request_id = request.request_id
            own_vectors = vectors.get(request_id)
            request.future.set_result(SequenceOutput(
                rows.get(request_id), started, finished, sparse.get(request_id),
                own_vectors[0] if own_vectors is not None else None, batch.num_sequences, batch.num_tokens,
            ))

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

    def _observe(self, step: Step, worker: Worker, seconds: float) -> None:
        batch = step.batch
        metrics.BATCH_SEQUENCES.labels(self.name, "prefill").observe(batch.num_sequences)
        metrics.BATCH_TOKENS.labels(self.name, "prefill").observe(batch.num_tokens)
        if logger.isEnabledFor(logging.INFO):
            calls = {request.call_id for request in step.requests if not request.future.done()}
            calls.discard("")  # library calls have no id
            shown = sorted(calls)[:_LOGGED_CALLS]
            more = f" +{len(calls) - len(shown)} more" if len(calls) > len(shown) else ""
            logger.info(
                "%s: batch of %d sequences, %d tokens on worker %d in %.1f ms; calls %s%s",
                self.name, batch.num_sequences, batch.num_tokens, worker.index, seconds * 1e3, " ".join(shown), more,
            )


def _fail(request: Request, error: Exception) -> None:
    if request.future is not None and not request.future.done():
        request.future.set_exception(error)
