"""What the task services (engine/tasks/) may ask of the engine core (engine/core/), and what they get back.

The port is narrow on purpose, as TEI's `Infer` is: run tokenizer work off the event loop, and run encoded
sequences through the scheduler. A service holds a port, never the Engine, so it cannot reach the workers,
the queues or another service through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import numpy as np

from embedserv.engine.tokenizer import Encoded
from embedserv.types import EmbedOutput, Timing

T = TypeVar("T")


@dataclass(frozen=True)
class SequenceOutput:
    """What one sequence's step gave, on the host, and when that step ran (perf_counter seconds)."""

    # The pooled vector or score logits ([dim] float32); None when the sequence asked for no dense output.
    row: np.ndarray | None
    started: float
    finished: float
    # SPARSE: (values [k] float32, vocabulary ids [k] int64, ascending); MULTI_VECTOR: [tokens, dim] float32.
    sparse: tuple[np.ndarray, np.ndarray] | None = None
    vectors: np.ndarray | None = None


def stack_rows(outputs: list[SequenceOutput]) -> np.ndarray:
    """[n, width] float32: the sequences' pooled vectors or score logits, in order."""
    return np.stack([output.row for output in outputs])


class Infer(Protocol):
    """The engine core as a task service sees it."""

    async def tokenize_with(self, encode: Callable[..., T], *args: Any) -> T:
        """`encode(*args)` in the tokenizer pool (never on the event loop)."""
        ...

    async def infer(
        self, encoded: list[Encoded], received: float, wanted: tuple[EmbedOutput, ...] = ()
    ) -> tuple[list[SequenceOutput], int, Timing]:
        """Every sequence through the scheduler: outputs in input order, the input tokens run (usage), and
        the call's timing from `received` (perf_counter seconds)."""
        ...
