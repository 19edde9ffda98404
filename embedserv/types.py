"""The types every package shares: what goes into and comes out of an Engine (one step of work is in
steps.py). Plain dataclasses and enums, no torch (a test enforces it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np


class ValueEnum(str, Enum):
    """A string enum whose str() is its value, as the wire and the logs carry it (Python 3.10 has no StrEnum)."""

    def __str__(self) -> str:
        return self.value


class Modality(ValueEnum):
    """What kinds of input a model takes (ModelInfo.modalities)."""

    TEXT = "text"
    IMAGE = "image"


@dataclass(frozen=True)
class ImageInput:
    """One image as a call sent it: encoded bytes (PNG, JPEG or WebP), decoded and preprocessed in the front
    end's pool (engine/inputs/images). Never a URL: the faces turn data URLs into bytes and refuse the rest."""

    data: bytes
    # Text in the same input after the image (one image-and-text input: the Qwen2-VL-style embedders, whose token
    # rules say `takes_interleaved`); empty: the image alone.
    text: str = ""


@dataclass(frozen=True)
class InterleavedInput:
    """One input of texts and images in the order the model reads them, one vector for all of it (OpenAI-style
    content lists: text, image, text, image); only the Qwen2-VL-style embedders (token rules' `takes_interleaved`)
    take it. A part is a text (str) or an encoded image (bytes, as ImageInput.data)."""

    parts: tuple[str | bytes, ...]


# What Embed takes per input (engine/inputs/image_inputs.simplest_input makes the common shapes str / ImageInput).
EmbedInput = str | ImageInput | InterleavedInput


class Task(str, Enum):
    EMBED = "embed"
    RERANK = "rerank"
    CLASSIFY = "classify"
    GENERATE = "generate"
    # Sparse vectors over the vocabulary (EmbedSparse) and several vectors per input (EmbedMultiVector).
    EMBED_SPARSE = "embed_sparse"
    EMBED_MULTI_VECTOR = "embed_multi_vector"
    # A label per token, and entities (ClassifyTokens; engine/tasks/token_classification.py).
    TOKEN_CLASSIFY = "token_classify"


class EmbedOutput(ValueEnum):
    """What an embedding request wants per input; one forward pass gives all it asks for."""

    # One pooled vector (after the model's Dense layers).
    DENSE = "dense"
    # Vocabulary id -> weight, non-zero entries only (SPLADE, bge-m3's sparse head).
    SPARSE = "sparse"
    # One vector per token (ColBERT-style heads, or the last hidden states).
    MULTI_VECTOR = "multi_vector"


class Activation(ValueEnum):
    """What turns a model's logits into the scores Rerank and Classify return (engine/tasks/outputs.py: activate)."""

    SIGMOID = "sigmoid"
    # Per row: the labels of one input sum to 1.
    SOFTMAX = "softmax"
    TANH = "tanh"
    IDENTITY = "identity"


class RerankMode(ValueEnum):
    """How Rerank builds a model's inputs and scores."""

    # Cosine similarity of the query's and each document's embeddings.
    EMBEDDINGS = "embeddings"
    # Query and document in one sequence, scored by a classifier with one label (a cross-encoder).
    PAIR = "pair"
    # A yes/no reranker's prompt around query and document, scored by the "yes" against "no" logit.
    TEMPLATE = "template"
    # Late interaction: the sum over the query's token vectors of each one's best dot product with the
    # document's token vectors (MultiVectorEncoder models).
    MAXSIM = "maxsim"


class TruncationDirection(ValueEnum):
    """Which end of a too-long input is cut: RIGHT keeps its start, LEFT keeps its end (tokenizers' names)."""

    RIGHT = "right"
    LEFT = "left"


class Encoding(ValueEnum):
    """How dense vectors are returned (engine/tasks/quantize.py): float32, float16; int8 / uint8 codes whose raw
    integer dot products rank as the floats do; sentence-transformers' quantize_embeddings per-dimension
    buckets (int8 / uint8_per_dimension); binary / ubinary packed bits, 8 dimensions a byte."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"
    UINT8 = "uint8"
    INT8_PER_DIMENSION = "int8_per_dimension"
    UINT8_PER_DIMENSION = "uint8_per_dimension"
    BINARY = "binary"
    UBINARY = "ubinary"


class ChunkSplitter(ValueEnum):
    """Where late chunking's chunks come from."""

    # The call's own character spans.
    SPANS = "spans"
    SENTENCES = "sentences"
    # Windows of chunk_tokens tokens, neighbours sharing overlap_tokens.
    TOKENS = "tokens"


@dataclass(frozen=True)
class LateChunking:
    """One vector per chunk of each input, pooled from the token states of the whole input."""

    splitter: ChunkSplitter = ChunkSplitter.SPANS
    # SPANS: per input, its chunks' character spans [start, end).
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    chunk_tokens: int = 0
    overlap_tokens: int = 0


@dataclass(frozen=True)
class EmbedParams:
    normalize: bool = True
    # Cut inputs past the model's limit instead of refusing them; None: the model's default
    # (ModelInfo.auto_truncate, --auto-truncate), resolved by the Engine.
    truncate: bool | None = None
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    # Keep only the first N dimensions, then normalize (Matryoshka).
    dimensions: int | None = None
    # A prompt name from the model's sentence-transformers config; None uses the model's default prompt.
    prompt_name: str | None = None
    # Which outputs per input (DENSE, SPARSE, MULTI_VECTOR), all from one forward pass.
    outputs: tuple[EmbedOutput, ...] = (EmbedOutput.DENSE,)
    # Inputs longer than the model's limit are embedded by windows (token-count-weighted mean of the
    # windows' pooled vectors) instead of cut or refused. Dense output only.
    chunking: bool = False
    # SPARSE: keep only the k largest values per input; None keeps all.
    sparse_top_k: int | None = None
    # The dense vectors' encoding (applied after dimensions and normalization).
    encoding: Encoding = Encoding.FLOAT32
    # The task adapter to run with (ModelInfo.task_adapters; also its prompt unless prompt_name names one); None
    # runs the base weights, unless prompt_name names a task.
    task: str | None = None
    # One vector per chunk of each input (EmbedResult.chunks) instead of one per input.
    late_chunking: LateChunking | None = None
    # Neither read nor fill the model's embedding cache.
    bypass_cache: bool = False


@dataclass(frozen=True)
class RerankParams:
    # Keep only the best N results; None keeps all.
    top_n: int | None = None
    # Logits instead of the model's activation (cross-encoders and yes/no rerankers).
    raw_scores: bool = False
    # Cut documents that do not fit beside the query instead of refusing them; None: the model's default.
    truncate: bool | None = None
    # The task instruction of instruction-following rerankers; None uses the model's default.
    instruction: str | None = None
    # A document that does not fit beside the query is split into windows and scored by its best one.
    chunking: bool = False


@dataclass(frozen=True)
class ClassifyParams:
    # None: the model's default (ModelInfo.auto_truncate).
    truncate: bool | None = None
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    # Logits instead of softmax (sigmoid for multi-label models) probabilities; with candidate_labels, the
    # entailment logits.
    raw_scores: bool = False
    # Zero-shot classification with an NLI model (engine/tasks/zero_shot.py): these labels, in this order, are
    # scored instead of the model's. Empty: ordinary classification.
    candidate_labels: tuple[str, ...] = ()
    # Turns a label into the hypothesis (str.format with the label); empty means "This example is {}.".
    hypothesis_template: str = ""
    # Each candidate label scored on its own (contradiction vs entailment) instead of a softmax across them.
    multi_label: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """How Generate picks tokens and when it stops. Checked by the engine (Engine.generate)."""

    # None: as many as the model's context (and one stream's share of the KV cache) holds.
    max_tokens: int | None
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


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationDelta:
    """One streamed piece of a generation: the text and tokens since the previous one."""

    text: str
    token_ids: tuple[int, ...]
    # None until the last delta.
    finish_reason: FinishReason | None = None
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


@dataclass(frozen=True)
class EngineRun:
    """One pass of a call's sequences through the engine, for the call's trace (server/calls.py): when the call
    was received and its sequences were tokenized (perf_counter seconds), and the outputs of the sequences that
    ran for it (engine/ports.py's SequenceOutputs: their steps' times and sizes)."""

    received: float
    tokenized: float
    outputs: Sequence[Any] = ()


@dataclass
class Timing:
    """Microseconds spent on one call; see proto Timing for what each covers."""

    queue_us: int = 0
    tokenization_us: int = 0
    inference_us: int = 0
    total_us: int = 0
    # The engine passes behind these figures, for the call's trace; they stay in the process that measured them.
    runs: tuple[EngineRun, ...] = ()

    @staticmethod
    def longest(timings: list[Timing]) -> Timing:
        """The timing of passes that ran at once: each part as long as the longest."""
        return Timing._combined(timings, max)

    @staticmethod
    def summed(timings: list[Timing]) -> Timing:
        """The timing of passes that ran one after another: each part the sum."""
        return Timing._combined(timings, sum)

    @staticmethod
    def _combined(timings: list[Timing], combine: Callable[[Iterable[int]], int]) -> Timing:
        def part(name: str) -> int:
            return combine(getattr(t, name) for t in timings)

        runs = tuple(run for t in timings for run in t.runs)
        return Timing(part("queue_us"), part("tokenization_us"), part("inference_us"), part("total_us"), runs)


@dataclass(frozen=True)
class SparseVector:
    # Vocabulary ids, ascending, int64; and their float32 values (non-zero only).
    indices: np.ndarray
    values: np.ndarray


@dataclass
class EmbedResult:
    # [num_inputs, dimension] in input order, in EmbedParams.encoding's dtype (float32, float16, int8, uint8;
    # [num_inputs, ceil(dimension / 8)] int8 / uint8 for the bit encodings); None when DENSE was not asked for.
    embeddings: np.ndarray | None
    prompt_tokens: int
    timing: Timing = field(default_factory=Timing)
    # SPARSE: one per input, in order.
    sparse: list[SparseVector] | None = None
    # MULTI_VECTOR: one [num_vectors, dim] float32 array per input, in order.
    multi_vectors: list[np.ndarray] | None = None
    # Late chunking: per input, its chunks' character spans and their encoded vectors [chunks, dim].
    chunks: list[tuple[tuple[tuple[int, int], ...], np.ndarray]] | None = None
    # INT8: value ~ code * encoding_scale; UINT8: value - the vector's mean ~ (code - 128) * encoding_scale;
    # 0 for other encodings (engine/tasks/quantize.py).
    encoding_scale: float = 0.0


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
    # An encoder-decoder model (BART, T5): Generate's prompt is the encoder input.
    is_encoder_decoder: bool = False
    # (layer, source layer) for each attention layer that reads an earlier layer's KV cache (Gemma 4).
    kv_shared_layers: tuple[tuple[int, int], ...] = ()
    # --kv-sharing-fast-prefill: the layers after the last KV writer run only the rows whose output is read.
    kv_sharing_fast_prefill: bool = False
    # What Embed can give (empty for models that do not embed), and the sparse and multi-vector widths.
    outputs: tuple[EmbedOutput, ...] = ()
    sparse_dimension: int = 0
    multi_vector_dimension: int = 0
    # The task adapters built into the checkpoint (jina-embeddings-v3's LoRA per task) a call may pick with
    # EmbedParams.task, in the model's order; empty for most. Served --lora adapters are lora_adapters.
    task_adapters: tuple[str, ...] = ()
    # A LoRA adapter served as a model of its own: its base model's name; "" for others.
    base_model: str = ""
    # A base model's LoRA adapters, by served name.
    lora_adapters: tuple[str, ...] = ()
    # --auto-truncate: calls that do not say `truncate` have their too-long inputs cut instead of refused.
    auto_truncate: bool = False
    # --input-type-prompt: (Cohere input_type, the model's prompt it embeds with) for the types configured, each
    # a prompt of the model's (checked at start-up); other types take server/http/cohere.py's defaults.
    input_type_prompts: tuple[tuple[str, str], ...] = ()
    # The inputs it takes: text, image (CLIP / SigLIP dual encoders: either; ColPali / ColQwen2: text queries
    # and page images).
    modalities: tuple[Modality, ...] = (Modality.TEXT,)
