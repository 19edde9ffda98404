"""FIFO batching for prefill-only work (embed, rerank, classify): no KV cache, no preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput


@dataclass
class PrefillRequest:
    """One sequence waiting to run. The engine owns the future that its result resolves."""

    request_id: int
    token_ids: list[int]
    pool_start: int = 0
    token_type_ids: list[int] | None = None
    cancelled: bool = field(default=False, compare=False)
    # Batches this sequence was on whose worker died before answering.
    attempts: int = field(default=0, compare=False)
    # The id of the call it belongs to, for the logs.
    call_id: str = field(default="", compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PrefillOnlyScheduler:
    """Packs waiting sequences first-come first-served under a token and a sequence budget.

    A sequence longer than the token budget runs alone rather than never.
    """

    def __init__(self, max_batch_tokens: int, max_batch_requests: int) -> None:
        if max_batch_tokens < 1 or max_batch_requests < 1:
            raise ValueError("batch budgets must be at least 1")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self._waiting: deque[PrefillRequest] = deque()
        # Cancelled sequences dropped from the queue without running, since the start.
        self.num_dropped = 0

    def add(self, request: PrefillRequest) -> None:
        self._waiting.append(request)

    def requeue(self, requests: list[PrefillRequest]) -> None:
        """Puts sequences back at the front, in their order (their worker died under them)."""
        self._waiting.extendleft(reversed(requests))

    def drain(self) -> list[PrefillRequest]:
        """Removes and returns every waiting sequence."""
        waiting = list(self._waiting)
        self._waiting.clear()
        return waiting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def schedule(self) -> SchedulerOutput | None:
        """Pops the next batch; cancelled requests are dropped without running. None when idle."""
        picked: list[ScheduledSequence] = []
        num_tokens = 0
        while self._waiting and len(picked) < self.max_batch_requests:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                self.num_dropped += 1
                continue
            if picked and num_tokens + request.num_tokens > self.max_batch_tokens:
                break
            self._waiting.popleft()
            num_tokens += request.num_tokens
            picked.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    token_ids=request.token_ids,
                    pool_start=request.pool_start,
                    token_type_ids=request.token_type_ids,
                )
            )
        if not picked:
            return None
        return SchedulerOutput(sequences=tuple(picked))
