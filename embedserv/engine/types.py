"""What goes into and comes out of an Engine: plain dataclasses, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Task(str, Enum):
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    GENERATE = "generate"


@dataclass(frozen=True)
class EmbedParams:
    normalize: bool = True
    truncate: bool = False
    # "right" keeps the start of the input, "left" keeps its end.
    truncation_direction: str = "right"
    # Keep only the first N dimensions, then normalize (Matryoshka).
    dimensions: int | None = None
    # A prompt name from the model's sentence-transformers config; None uses the model's default prompt.
    prompt_name: str | None = None


@dataclass
class Timing:
    """Microseconds spent on one call; see proto Timing for what each covers."""

    queue_us: int = 0
    tokenization_us: int = 0
    inference_us: int = 0
    total_us: int = 0


@dataclass
class EmbedResult:
    # [num_inputs, dimension] float32, in input order.
    embeddings: np.ndarray
    prompt_tokens: int
    timing: Timing = field(default_factory=Timing)


@dataclass(frozen=True)
class TokenizedText:
    ids: list[int]
    tokens: list[str]
    # (start, end) character offsets per token.
    offsets: list[tuple[int, int]]
    special: list[bool]


@dataclass(frozen=True)
class ModelInfo:
    """What ListModels reports for one served model."""

    name: str
    tasks: tuple[Task, ...]
    architecture: str
    is_causal: bool
    pooling: str
    dimension: int
    max_input_tokens: int
    prompt_names: tuple[str, ...]
    dtype: str
    device: str
    attention_backend: str
