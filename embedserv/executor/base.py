"""What the engine sees of a worker, wherever it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.steps import StepBatch, StepOutput


class WorkerDied(Exception):
    """The worker process ended (exit, signal, or the watchdog) before the batch's result came back.

    `sent` tells whether the batch reached the worker: one that never did has not been tried.
    """

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


@dataclass(frozen=True)
class WorkerStats:
    index: int
    pid: int
    ready: bool
    # Times this worker's process was replaced after dying.
    restarts: int
    batches: int
    # Seconds the worker spent running batches (its current process; restarts begin again at 0).
    busy_seconds: float
    # Of the restarts, those past the memory ceiling (--worker-memory-limit); the last resident size read (0: none).
    memory_restarts: int = 0
    rss_bytes: int = 0


class Worker(Protocol):
    index: int
    # This worker's KV cache (None for a model that does not generate); set once ready.
    kv_cache: KvCacheLayout | None
    # Bumped each time a new process takes over, so state tied to the old one (KV blocks) is dropped.
    incarnation: int
    # Called with no arguments whenever `ready` may have changed; set by the engine.
    on_change: Callable[[], None]
    # Past its memory ceiling, waiting to be replaced: no new prefill steps or generation streams (they wait for
    # its successor), and steps of streams already on it go on until `idle()` (set by the engine) says none is left.
    recycling: bool
    idle: Callable[[], bool]

    @property
    def ready(self) -> bool: ...

    def stats(self) -> WorkerStats: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def wait_ready(self) -> None: ...

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        """Runs one step. `generation`: the step continues this worker's running batch of generation streams
        (it goes as a delta against it, executor/step_delta.py); else it is a whole prefill-only batch."""
        ...
