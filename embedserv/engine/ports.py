"""What the task services (engine/tasks/) may ask of the engine core (engine/core/), and what they get back.

The port is narrow on purpose, as TEI's `Infer` is: run tokenizer work off the event loop, and run encoded
sequences through the scheduler. A service holds a port, never the Engine, so it cannot reach the workers,
the queues or another service through it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import numpy as np

from embedserv.engine.inputs.tokenizer import Encoded
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
    # The step's batch: sequences and tokens in it (tracing's batch spans; 0 where unknown).
    batch_sequences: int = 0
    batch_tokens: int = 0


# Up to this many characters (about 1 ms of tokenizing) a call is tokenized on the event loop: handing it to
# the tokenizer thread and back cost more than that under load, in GIL waits and wake-ups (one-text calls
# 1.1-1.5x faster on 2 cores; docs/PERFORMANCE.md, issue 34). Longer inputs go to the pool, so the loop never
# stalls on them.
INLINE_TOKENIZE_CHARS = 4096


async def run_tokenizer(pool: Executor, encode: Callable[..., T], args: tuple, chars: int | None) -> T:
    """What both engine cores' tokenize_with do (in process and over the front-end link)."""
    if chars is not None and chars <= INLINE_TOKENIZE_CHARS:
        return encode(*args)
    return await asyncio.get_running_loop().run_in_executor(pool, encode, *args)


def stack_rows(outputs: list[SequenceOutput]) -> np.ndarray:
    """[n, width] float32: the sequences' pooled vectors or score logits, in order."""
    return np.stack([output.row for output in outputs])


class Infer(Protocol):
    """The engine core as a task service sees it."""

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        """`encode(*args)` in the tokenizer pool; on the event loop when the caller says the inputs hold no more
        than INLINE_TOKENIZE_CHARS characters in all (`chars`)."""
        ...

    async def infer(
        self, encoded: list[Encoded], received: float, wanted: tuple[EmbedOutput, ...] = (), use_cache: bool = True
    ) -> tuple[list[SequenceOutput], int, Timing]:
        """Every sequence through the scheduler: outputs in input order, the input tokens run (usage), and
        the call's timing from `received` (perf_counter seconds). With `use_cache` off the model's embedding
        cache (if it has one) is neither read nor filled."""
        ...
