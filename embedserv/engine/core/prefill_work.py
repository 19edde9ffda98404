"""The model's prefill queue (PrefillWork), a step source of every worker (dispatch.py places its steps).

A call's sequences become Requests that carry the call's futures; a request is in the FIFO queue or in a step on a
worker, never in a table. When a worker dies, its steps' sequences go back to the front of the queue for one more
try if another worker is alive, else fail with NotReady (UNAVAILABLE); while none is alive, calls fail at once
instead of queueing for a restart that may not come.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable

from embedserv import metrics
from embedserv.call_class import stamp
from embedserv.engine.core.dispatch import Step
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import SequenceOutput
from embedserv.errors import NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.logs import REQUEST_ID
from embedserv.models.loading.tasks import TaskSpec
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, batch_of
from embedserv.scheduler.request import Request
from embedserv.scheduler.waiting import DEFAULT_POLICY, PriorityPolicy
from embedserv.steps import OutputKind, StepOutput
from embedserv.types import EmbedOutput

logger = logging.getLogger(__name__)

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
        policy: PriorityPolicy = DEFAULT_POLICY,
    ) -> None:
        """`wake`: the dispatcher's, called when there is new work. `task`: the model's (an encoder-decoder's
        sequences are its encoder's input). `policy`: how priorities order the queue."""
        self.name = name
        self.workers = workers
        self.output = output
        self.decoder_start = task.decoder_start_token_id if task is not None else None
        self.decoder_reads_start_only = task is not None and task.prefill_decoder_input == "start"
        self.scheduler = PrefillOnlyScheduler(
            max_batch_tokens,
            max_batch_requests,
            policy.short_step_tokens,
            policy.max_wait_s,
            default_priority=policy.default_priority,
        )
        self.default_priority = policy.default_priority
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
            request = Request(next(self._ids), decoder, self.output, encoder_token_ids=ids, call_id=REQUEST_ID.get())
            return stamp(request, self.default_priority)
        request = Request(
            next(self._ids),
            sequence.ids,
            self.output,
            pool_start=sequence.pool_start,
            token_type_ids=sequence.token_type_ids,
            call_id=REQUEST_ID.get(),
            outputs=() if wanted == (EmbedOutput.DENSE,) else wanted,
            adapter=sequence.adapter,
            pixels=sequence.pixels,
            image_grids=sequence.image_grids,
        )
        return stamp(request, self.default_priority)

    def running_counts(self) -> Counter[tuple[int, str]]:
        """Sequences on workers now per (priority, tenant) (the metrics thread reads it)."""
        return Counter((r.priority, r.tenant) for step in list(self._running) for r in step.requests)

    def workers_changed(self) -> None:
        """A worker became ready or died: with none alive, fail what is queued (what is on a worker ends with
        its step)."""
        if not any(worker.ready or worker.recycling for worker in self.workers):
            error = NotReady(f"no worker of model {self.name} is running (restarting); retry shortly")
            for request in self.scheduler.drain():
                _fail(request, error)

    async def run(self, requests: list[Request]) -> list[SequenceOutput]:
        """Each request's output, in order."""
        if not self.accepting:
            raise NotReady(f"model {self.name} is not running; retry shortly")
        # A worker being replaced past its memory ceiling is back soon: its calls wait for it.
        if not any(worker.ready or worker.recycling for worker in self.workers):
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
