"""The waiting sequences of one model, in the order they should run. No torch.

Higher priority first; within a priority, the tenants (API keys) take turns, one sequence each, and each tenant's
sequences keep their order. Aging bounds the wait: a sequence that has waited `max_wait_s` goes before any other,
oldest first, whatever its priority. With one priority and one tenant (a server without keys or priorities) this
is first-come first-served.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from embedserv.scheduler.request import Request


class WaitingQueue:
    def __init__(self, max_wait_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`max_wait_s`: the aging bound (None: strict priority); `clock`: seconds, monotonic (tests pass a fake)."""
        self.max_wait_s = max_wait_s
        self.clock = clock
        # priority -> tenant -> its sequences; a tenant's turn is its place in the dict (first: next).
        self._levels: dict[int, dict[str, deque[Request]]] = {}
        # Read from the metrics thread: a plain int.
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Request]:
        """A snapshot of every waiting sequence (safe while the loop changes the queue from another thread)."""
        snapshot = [
            request for level in list(self._levels.values()) for q in list(level.values()) for request in tuple(q)
        ]
        return iter(snapshot)

    def append(self, request: Request) -> None:
        """Queues a new sequence behind its tenant's others; its wait starts now."""
        if not request.arrival:
            request.arrival = self.clock()
        self._levels.setdefault(request.priority, {}).setdefault(request.tenant, deque()).append(request)
        self._count += 1

    def appendleft(self, request: Request) -> None:
        """Puts a sequence back before all others of its priority (a retry, a preempted stream); it keeps its
        arrival, so its wait counts from when it first came."""
        if not request.arrival:
            request.arrival = self.clock()
        level = self._levels.setdefault(request.priority, {})
        queue = level.pop(request.tenant, None) or deque()
        queue.appendleft(request)
        # Its tenant's turn comes first.
        self._levels[request.priority] = {request.tenant: queue, **level}
        self._count += 1

    def first(self, now: float | None = None) -> Request | None:
        """The sequence that runs next (not removed), or None when empty."""
        if not self._count:
            return None
        if self.max_wait_s is not None:
            now = self.clock() if now is None else now
            oldest = min((q[0] for level in self._levels.values() for q in level.values()), key=_arrival)
            if now - oldest.arrival >= self.max_wait_s:
                return oldest
        level = self._levels[max(self._levels)]
        return next(iter(level.values()))[0]

    def pop(self, request: Request) -> None:
        """Removes `request`, which first() returned; its tenant's turn passes to the next tenant."""
        level = self._levels[request.priority]
        queue = level.pop(request.tenant)
        if queue.popleft() is not request:
            raise ValueError("pop() takes the sequence first() returned")
        if queue:
            level[request.tenant] = queue
        elif not level:
            del self._levels[request.priority]
        self._count -= 1

    def remove(self, request: Request) -> None:
        """Removes a waiting sequence wherever it is (ValueError if it is not waiting)."""
        level = self._levels[request.priority]
        queue = level[request.tenant]
        queue.remove(request)
        if not queue:
            del level[request.tenant]
            if not level:
                del self._levels[request.priority]
        self._count -= 1

    def clear(self) -> list[Request]:
        """Removes and returns every waiting sequence."""
        waiting = list(self)
        self._levels.clear()
        self._count = 0
        return waiting

    def top_priority(self) -> int | None:
        """The highest priority waiting, or None when empty."""
        return max(self._levels) if self._levels else None

    def counts(self) -> dict[tuple[int, str], int]:
        """Waiting sequences per (priority, tenant), for the metrics (safe from another thread)."""
        return {
            (priority, tenant): len(q)
            for priority, level in list(self._levels.items())
            for tenant, q in list(level.items())
            if q
        }


def _arrival(request: Request) -> float:
    return request.arrival


@dataclass(frozen=True)
class PriorityPolicy:
    """How a model's schedulers treat priorities (config.ModelConfig.priority_policy)."""

    # The priority of a call that names none.
    default_priority: int = 0
    # A prefill step holding lower-priority sequences while higher ones come stops at this many tokens
    # (PrefillOnlyScheduler); None: the full budget.
    short_step_tokens: int | None = None
    # WaitingQueue's aging bound; None: strict priority.
    max_wait_s: float | None = None


DEFAULT_POLICY = PriorityPolicy()
