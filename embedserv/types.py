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


@dataclass(frozen=True)
class RerankParams:
    # Keep only the best N results; None keeps all.
    top_n: int | None = None
    # Logits instead of the model's activation (cross-encoders and yes/no rerankers).
    raw_scores: bool = False
    # Cut documents that do not fit beside the query instead of refusing them.
    truncate: bool = False
    # The task instruction of instruction-following rerankers; None uses the model's default.
    instruction: str | None = None


@dataclass(frozen=True)
class ClassifyParams:
    truncate: bool = False
    truncation_direction: str = "right"
    # Logits instead of softmax (sigmoid for multi-label models) probabilities.
    raw_scores: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """How Generate picks tokens and when it stops. Checked by the engine (Engine.generate)."""

    max_tokens: int
    # 0 is greedy (argmax); above 0 scales the logits before sampling.
    temperature: float = 0.0
    # Keep the smallest set of most likely tokens whose probability reaches top_p; in (0, 1].
    top_p: float = 1.0
    # Keep only the top_k most likely tokens; 0 keeps all.
    top_k: int = 0
    # Same seed, same prompt: same text. None draws from the server's generator.
    seed: int | None = None
    # The text ends just before the first of these that appears.
    stop: tuple[str, ...] = ()
    # Keep going past the model's end-of-sequence token.
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationDelta:
    """One streamed piece of a generation: the text and tokens since the previous one."""

    text: str
    token_ids: tuple[int, ...]
    # None until the last delta; then length, stop, eos or cancelled.
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class KvCacheUsage:
    block_size: int
    total_blocks: int
    used_blocks: int
    # Requests preempted (and later recomputed) since start-up because blocks ran out.
    preemptions: int
    # Prompt tokens whose KV came from the prefix cache instead of being computed, since start-up.
    cached_prompt_tokens: int = 0


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
class RankedDocument:
    # Position of the document in the request.
    index: int
    score: float


@dataclass
class RerankResult:
    # Best first.
    results: list[RankedDocument]
    prompt_tokens: int
    timing: Timing = field(default_factory=Timing)


@dataclass
class ClassifyResult:
    # [num_inputs, num_labels] float32, in input order and the model's label order.
    scores: np.ndarray
    labels: tuple[str, ...]
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
    # Embedding pooling, or the token a score head reads (cls / lasttoken).
    pooling: str
    # Embedding dimension; 0 for models that do not embed.
    dimension: int
    max_input_tokens: int
    prompt_names: tuple[str, ...]
    dtype: str
    device: str
    attention_backend: str
    # Classifier label names in the model's order; empty for other models.
    labels: tuple[str, ...] = ()
