"""The Core port: one served model's engine as the task services (engine/tasks/) and the front-end server see it.

It is narrow on purpose, as TEI's `Infer` is: run tokenizer work off the event loop, run input sequences
through the scheduler, stream a generation, and say how the model is doing. Two classes implement it:
LocalCore (engine/core/local_core.py: the workers are this process's) and RemoteCore (server/remote_core.py:
over the link to the engine host, with `--frontends N`). A service holds a Core, never the Engine, so it
cannot reach the workers, the queues or another service through it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.types import EmbedOutput, GenerationDelta, KvCacheUsage, SamplingParams, Timing

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


class Inferred(NamedTuple):
    """What Core.infer gives: outputs in input order, the input tokens run (usage), and the call's timing."""

    outputs: list[SequenceOutput]
    tokens: int
    timing: Timing


@dataclass(frozen=True)
class CoreStatus:
    """How a model is doing, as health and ListModels read it."""

    # Started, not stopped, and no step loop crashed (workers may be restarting).
    running: bool = False
    # Running with at least one worker ready: what health reports for the model.
    serving: bool = False
    # Blocks in use, summed over the workers (None for models that do not generate).
    kv_cache: KvCacheUsage | None = None


class Core(Protocol):
    def status(self) -> CoreStatus: ...

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        """`encode(*args)` in the tokenizer pool; on the event loop when the caller says the inputs hold no more
        than INLINE_TOKENIZE_CHARS characters in all (`chars`; engine/inputs/tokenizer.py)."""
        ...

    async def infer(
        self,
        sequences: list[InputSequence],
        received: float,
        wanted: tuple[EmbedOutput, ...] = (),
        use_cache: bool = True,
    ) -> Inferred:
        """Every sequence through the scheduler: outputs in input order, the input tokens run (usage), and the
        call's timing from `received` (perf_counter seconds). With `use_cache` off the model's embedding cache
        (if it has one) is neither read nor filled."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        decoder_prompt: str = "",
        add_special_tokens: bool = True,
        stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """Streams the text the model appends to `prompt`; the last delta carries the finish reason. With
        `stream` False there is only that delta, with all the text and tokens: for callers that answer once (at
        128 streams each step would otherwise wake every caller).
        Encoder-decoder models: `prompt` is the encoder's input, and the decoder starts from its start token
        followed by `decoder_prompt`; decoder-only models refuse a decoder_prompt. A prompt of token ids is
        used as given; a text prompt gets the model's special tokens unless `add_special_tokens` is False
        (a chat template's output carries its own). `params.max_tokens` None: as many as the context holds."""
        ...
