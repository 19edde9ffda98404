"""A model's load as routers and autoscalers read it (server/load_metrics.py): calls waiting and running, and
how busy its workers were lately. No torch.

Counted on the engine's event loop where the events happen, and read from the metrics thread at scrape time:
plain ints and a tuple snapshot, so a scrape never iterates a container the loop is changing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# The busy ratio's sliding window (seconds): long enough to smooth single batches, short enough to follow
# a burst within one autoscaler period.
BUSY_WINDOW_S = 10.0


@dataclass(frozen=True)
class ModelLoad:
    """One model's load at a scrape: API calls (not sequences) waiting for their first batch and running,
    tokens of the sequences waiting for a batch, and the workers' busy share of the last BUSY_WINDOW_S."""

    requests_waiting: int
    requests_running: int
    waiting_tokens: int
    worker_busy_ratio: float


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


class BusyWindow:
    """The share of the last `window_s` seconds during which a worker had a step in flight.

    begin() and end() bracket each busy period (the first step sent to the worker, the last one answered);
    ratio() adds up the busy time within the window, the open period included, so a step that runs for a
    minute reads busy throughout, not only once it ends. Before `window_s` has passed since it was made, the
    window is the time since then.

    Periods that end within `window_s / 100` of the start of the last record join it, so a worker running
    thousands of short steps keeps about a hundred records; the one record the window's start cuts through
    counts its busy time pro rata (at most 1% of the window off)."""

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
