"""The one interface of the places a worker's step loop takes steps from (step_loop.py).

Two sources implement it: the model's shared PrefillQueue (prefill.py) and a worker's GenerationStreams
(generation.py). A loop asks its sources for work in the order it was given them, so that order is the
priority; a source knows nothing of the others.
"""

from __future__ import annotations

from typing import Protocol

from embedserv.executor.base import Worker, WorkerDied
from embedserv.steps import StepBatch, StepOutput


class LoopView(Protocol):
    """What a source sees of a worker's step loop."""

    worker: Worker

    @property
    def in_flight(self) -> int: ...

    def wake(self) -> None:
        """There may be work: the loop looks at its sources again."""
        ...


class StepSource(Protocol):
    # True when a step can only be scheduled once the previous one's results are in (generation: the
    # next step feeds the sampled tokens back); the loop then keeps at most one of its steps in flight.
    one_step_at_a_time: bool

    def add_loop(self, loop: LoopView) -> None:
        """A loop that runs this source's steps: woken whenever the source has new work."""
        ...

    def loop_started(self) -> None: ...

    def loop_stopped(self) -> None:
        """The loop stopped (the engine stops, or the loop crashed after fail_all): nothing of it runs."""
        ...

    def schedule(self, loop: LoopView) -> StepBatch | None:
        """The next step for `loop`'s worker (ready, with room), or None: nothing to run for it now."""
        ...

    async def step_done(self, batch: StepBatch, output: StepOutput, worker: Worker, started: float) -> None: ...

    def step_failed(self, batch: StepBatch, exc: Exception) -> None: ...

    def worker_died(self, batch: StepBatch, died: WorkerDied) -> None: ...

    def fail_all(self, error: Exception) -> None:
        """Fails everything that waits on this source (the loop crashed)."""
        ...
