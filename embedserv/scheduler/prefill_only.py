"""Batching for prefill-only work (embed, rerank, classify): no KV cache, no preemption; and the counts of
the calls whose sequences wait and run, which routers and autoscalers read (server/load_metrics.py). No torch.

Counted on the engine's event loop where the events happen, and read from the metrics thread at scrape time:
plain ints, so a scrape never iterates a container the loop is changing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from embedserv.scheduler.request import Request, RequestStatus
from embedserv.scheduler.waiting import WaitingQueue
from embedserv.steps import ScheduledSequence, StepBatch

# How long after a call of some priority arrived lower-priority steps stay short (see PrefillOnlyScheduler).
PRIORITY_WINDOW_S = 5.0


class PrefillOnlyScheduler:
    """Packs waiting sequences under a token and a sequence budget, in WaitingQueue's order (priority, then
    tenants in turn, first come first served within each; aged sequences first).

    A sequence longer than the token budget runs alone rather than never. A step that holds sequences below the
    default priority, or below a priority that arrived within the last PRIORITY_WINDOW_S, stops at
    `priority_batch_tokens`: a query arriving during bulk work then waits for a short step, not a full one.
    """

    def __init__(
        self,
        max_batch_tokens: int,
        max_batch_requests: int,
        priority_batch_tokens: int | None = None,
        max_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        default_priority: int | None = None,
    ) -> None:
        if max_batch_tokens < 1 or max_batch_requests < 1:
            raise ValueError("batch budgets must be at least 1")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.priority_batch_tokens = min(priority_batch_tokens or max_batch_tokens, max_batch_tokens)
        self._waiting = WaitingQueue(max_wait_s, clock)
        # priority -> when a sequence of it last arrived (a handful of levels).
        self._last_seen: dict[int, float] = {}
        # Sequences below it are background work: always in short steps (None: only while higher ones come).
        self.default_priority = default_priority
        # Cancelled sequences dropped from the queue without running, since the start.
        self.num_dropped = 0
        # Tokens of the waiting sequences (what a batch would cost them), kept as they come and go.
        self.waiting_tokens = 0

    def add(self, request: Request) -> None:
        self._waiting.append(request)
        self._last_seen[request.priority] = request.arrival
        self.waiting_tokens += _cost(request)

    def requeue(self, requests: list[Request]) -> None:
        """Puts sequences back at the front of their priority, in their order (their worker died under them)."""
        for request in reversed(requests):
            self._waiting.appendleft(request)
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
        waiting = self._waiting.clear()
        self.waiting_tokens = 0
        for request in waiting:
            # Out of the queue: a later cancel() must not take its tokens off again.
            request.status = RequestStatus.FINISHED
        return waiting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_counts(self) -> dict[tuple[int, str], int]:
        """Waiting sequences per (priority, tenant) (the metrics thread reads it)."""
        return self._waiting.counts()

    def schedule(self) -> StepBatch | None:
        """Pops the next batch; cancelled requests are dropped without running. None when idle."""
        picked = self.pick()
        return batch_of(picked) if picked else None

    def pick(self) -> list[Request]:
        """The next batch's requests, now RUNNING (schedule() without building the batch)."""
        now = self._waiting.clock()
        urgent = self._recent_top_priority(now)
        picked: list[Request] = []
        num_tokens = 0
        while len(picked) < self.max_batch_requests:
            request = self._waiting.first(now)
            if request is None:
                break
            if request.cancelled:
                self._waiting.pop(request)
                self.num_dropped += 1
                continue
            cost = _cost(request)
            budget = self.max_batch_tokens if request.priority >= urgent else self.priority_batch_tokens
            if picked and num_tokens + cost > budget:
                break
            self._waiting.pop(request)
            request.status = RequestStatus.RUNNING
            self.waiting_tokens -= cost
            num_tokens += cost
            if request.call is not None:
                request.call.start()
            picked.append(request)
        return picked

    def _recent_top_priority(self, now: float) -> int:
        """The highest priority that arrived within PRIORITY_WINDOW_S, waits still, or is the default."""
        for priority, seen in list(self._last_seen.items()):
            if now - seen > PRIORITY_WINDOW_S:
                del self._last_seen[priority]
        top = self._waiting.top_priority()
        floor = () if self.default_priority is None else (self.default_priority,)
        return max((*self._last_seen, *(() if top is None else (top,)), *floor), default=0)


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
                image_grids=request.image_grids,
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
