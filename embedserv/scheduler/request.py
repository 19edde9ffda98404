"""The one request type both scheduler policies queue: a sequence to pool, score or continue. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np

from embedserv.steps import OutputKind
from embedserv.types import EmbedOutput, SamplingParams


class CallProgress(Protocol):
    """The call a prefill request belongs to (prefill_only.AdmittedCall), as the scheduler sees it."""

    def start(self) -> None:
        """One of the call's sequences went into a batch."""
        ...


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    output: OutputKind
    # SAMPLE requests: how to pick tokens and how many (max_tokens).
    sampling: SamplingParams | None = None
    # POOL: pooling starts this many tokens in; pair inputs' segment ids (None: all zeros).
    pool_start: int = 0
    token_type_ids: list[int] | None = None
    # Encoder-decoder models: the encoder's input, which sizes the fixed-size KV groups (cross attention).
    encoder_token_ids: list[int] = field(default_factory=list)
    # The encoder runs in the next step (set at each admission: its cross KV was never written, or was
    # dropped by a preemption).
    encoder_pending: bool = False
    # The encoder input's hash, where decoder prefix-cache chains start (kv_cache_manager._root_hash).
    encoder_hash: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (generation), or 0.
    num_computed_tokens: int = 0
    # One block table per KV-cache group; empty for prefill-only work.
    block_ids: list[list[int]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Set when the caller went away: dropped at the next schedule() without running.
    cancelled: bool = False
    # Steps this request was on whose worker died before answering.
    attempts: int = 0
    # The id of the call it belongs to, for the logs.
    call_id: str = ""
    # POOL: the outputs to compute (empty: DENSE only).
    outputs: tuple[EmbedOutput, ...] = ()
    # The adapter its tokens run with (InputSequence.adapter); -1: the base weights.
    adapter: int = -1
    # The call it belongs to (prefill): marked started when the sequence goes into a batch (load metrics).
    call: CallProgress | None = None
    # An input's images: their patch rows and one grid per image (steps.ScheduledSequence.pixels); None for texts.
    pixels: np.ndarray | None = None
    image_grids: tuple[tuple[int, ...], ...] = ()
    # Higher runs sooner (scheduler/waiting.py); the API key's name the call came with ("": none).
    priority: int = 0
    tenant: str = ""
    # The scheduler clock's time when it first queued (aging); 0.0 until then.
    arrival: float = 0.0
    # Prefill: the caller's asyncio future, given the sequence's output (engine/core/prefill.py).
    future: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        return len(self.encoder_token_ids)

    @property
    def max_tokens(self) -> int:
        if self.sampling is None or self.sampling.max_tokens is None:
            return 0
        return self.sampling.max_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
