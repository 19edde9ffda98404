"""FIFO batching for prefill-only work (embed, rerank, classify): no KV cache, no preemption; and the counts of
the calls whose sequences wait and run, which routers and autoscalers read (server/load_metrics.py). No torch.

Counted on the engine's event loop where the events happen, and read from the metrics thread at scrape time:
plain ints, so a scrape never iterates a container the loop is changing.
"""

from __future__ import annotations

from collections import deque

from embedserv.scheduler.request import Request, RequestStatus
from embedserv.steps import ScheduledSequence, StepBatch


class PrefillOnlyScheduler:
    """Packs waiting sequences first-come first-served under a token and a sequence budget.

    A sequence longer than the token budget runs alone rather than never.
    """

    def __init__(self, max_batch_tokens: int, max_batch_requests: int) -> None:
        if max_batch_tokens < 1 or max_batch_requests < 1:
            raise ValueError("batch budgets must be at least 1")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self._waiting: deque[Request] = deque()
        # Cancelled sequences dropped from the queue without running, since the start.
        self.num_dropped = 0
        # Tokens of the waiting sequences (what a batch would cost them), kept as they come and go.
        self.waiting_tokens = 0

    def add(self, request: Request) -> None:
        self._waiting.append(request)
        self.waiting_tokens += _cost(request)

    def requeue(self, requests: list[Request]) -> None:
        """Puts sequences back at the front, in their order (their worker died under them)."""
        self._waiting.extendleft(reversed(requests))
        for request in requests:
            request.status = RequestStatus.WAITING
            self.waiting_tokens += _cost(request)

    def cancel(self, request: Request) -> None:
        """Its caller went away: dropped at the next schedule() without running. A waiting sequence's tokens
        stop counting at once, not when a busy worker next takes a batch."""
        if not request.cancelled and request.status is RequestStatus.WAITING:
            self.waiting_tokens -= _cost(request)
        request.cancelled = True

    def drain(self) -> list[Request]:
        """Removes and returns every waiting sequence."""
        waiting = list(self._waiting)
        self._waiting.clear()
        self.waiting_tokens = 0
        for request in waiting:
            # Out of the queue: a later cancel() must not take its tokens off again.
            request.status = RequestStatus.FINISHED
        return waiting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def schedule(self) -> StepBatch | None:
        """Pops the next batch; cancelled requests are dropped without running. None when idle."""
        picked = self.pick()
        return batch_of(picked) if picked else None

    def pick(self) -> list[Request]:
        """The next batch's requests, now RUNNING (schedule() without building the batch)."""
        picked: list[Request] = []
        num_tokens = 0
        while self._waiting and len(picked) < self.max_batch_requests:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                self.num_dropped += 1
                continue
            cost = _cost(request)
            if picked and num_tokens + cost > self.max_batch_tokens:
                break
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.waiting_tokens -= cost
            num_tokens += cost
            if request.call is not None:
                request.call.start()
            picked.append(request)
        return picked


def batch_of(requests: list[Request]) -> StepBatch:
    """The step that computes `requests` (prefill-only: every token of each, no KV)."""
    return StepBatch(
        sequences=tuple(
            ScheduledSequence(
                request_id=request.request_id,
                token_ids=tuple(request.prompt_token_ids),
                output=request.output,
                pool_start=request.pool_start,
                token_type_ids=None if request.token_type_ids is None else tuple(request.token_type_ids),
                encoder_token_ids=tuple(request.encoder_token_ids),
                encoder_len=len(request.encoder_token_ids),
                outputs=request.outputs,
                adapter=request.adapter,
                pixels=request.pixels,
                image_grid=request.image_grid,
            )
            for request in requests
        )
    )


def _cost(request: Request) -> int:
    """A sequence's tokens in a batch: an encoder-decoder request costs its encoder and its decoder tokens."""
    return len(request.prompt_token_ids) + len(request.encoder_token_ids)


class CallCounts:
    """Calls admitted to a model and not answered, split into waiting (no sequence in a batch yet) and running."""

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0

    def admit(self) -> AdmittedCall:
        self.waiting += 1
        return AdmittedCall(self)


class AdmittedCall:
    """One admitted call; its sequences' Requests carry it, so the scheduler marks it started."""

    __slots__ = ("_counts", "_done", "started")

    def __init__(self, counts: CallCounts) -> None:
        self._counts = counts
        self.started = False
        self._done = False

    def start(self) -> None:
        """One of its sequences went into a batch (idempotent)."""
        if not self.started and not self._done:
            self.started = True
            self._counts.waiting -= 1
            self._counts.running += 1

    def done(self) -> None:
        """Answered, failed or cancelled (idempotent)."""
        if self._done:
            return
        self._done = True
        if self.started:
            self._counts.running -= 1
        else:
            self._counts.waiting -= 1
