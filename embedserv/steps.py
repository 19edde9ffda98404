"""One step of work between the scheduler, the engine and a worker: the sequences a forward pass computes and
what it gives back. Plain dataclasses and enums, no torch (a test enforces it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from embedserv.types import EmbedOutput, SamplingParams


class OutputKind(str, Enum):
    """What a sequence's step yields: a pooled embedding, a score head's logits, or a sampled token."""

    POOL = "pool"
    SCORE = "score"
    SAMPLE = "sample"


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence of a step: the tokens to compute now and where its keys and values live."""

    request_id: int
    # This step's tokens: a whole input (prefill-only), a prompt chunk, or the one token being decoded.
    token_ids: tuple[int, ...]
    output: OutputKind
    # Tokens of the sequence already computed (in the KV cache): the position of token_ids[0].
    start_position: int = 0
    # One block table per KV-cache group, each covering start_position + len(token_ids) tokens;
    # empty when the step keeps no KV (prefill-only work).
    block_ids: tuple[tuple[int, ...], ...] = ()
    # The step reaches the sequence's last known token, so it yields an output (always, without KV).
    produces_output: bool = True
    # SAMPLE sequences: how to pick their tokens (read where the step produces an output).
    sampling: SamplingParams | None = None
    # POOL: pooling starts this many tokens in (prompt tokens excluded from the mean).
    pool_start: int = 0
    # Segment ids of pair inputs (cross-encoders); None means all zeros.
    token_type_ids: tuple[int, ...] | None = None
    # Encoder-decoder models: the encoder's input when the encoder runs in this step (the request's first
    # step after admission), else empty; and its length, on every step (cross-attention reads that many keys).
    encoder_token_ids: tuple[int, ...] = ()
    encoder_len: int = 0
    # POOL: the outputs to compute; empty means DENSE only.
    outputs: tuple[EmbedOutput, ...] = ()
    # The adapter its tokens run with: a task adapter's index in ModelInfo.task_adapters, or a --lora adapter's
    # in ModelInfo.lora_adapters; -1: the base weights.
    adapter: int = -1
    # An input with images: their preprocessed pixels as patch rows [rows, patch_dim] float32, the images' rows
    # one after another in the input's order, each row one patch flattened in the patch embedding's weight order
    # (channels, then patch rows, then columns; Qwen2-VL's processor order for its patches). Dual encoders (CLIP,
    # SigLIP): one image, its rows the sequence's tokens, one each (CLIP's class token a row of zeros first),
    # token_ids placeholders. Vision-language models (ColPali, ColQwen2, the Qwen2-VL-style embedders): the vision
    # tower's input, token_ids the language model's tokens with each image's placeholder tokens. None: a text.
    pixels: np.ndarray | None = None
    # One grid per image, in patches as its vision tower needs it: (t, h, w) for Qwen2-VL's; (h, w) otherwise.
    # Only the Qwen2-VL-style embedders send several images in one sequence; each then has t * h * w rows of
    # `pixels` (worker/image_inputs.image_rows).
    image_grids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepBatch:
    """What one forward pass computes; both scheduler policies emit it, every worker executes it."""

    sequences: tuple[ScheduledSequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def uses_kv_cache(self) -> bool:
        return any(s.block_ids for s in self.sequences)


@dataclass(frozen=True)
class RaggedRows:
    """A variable number of entries per request, packed: token vectors (values [total, dim]) or sparse
    vectors (values [total] with their vocabulary ids in indices [total])."""

    request_ids: tuple[int, ...]
    # [len(request_ids)] int64: entries per request, in request_ids' order.
    counts: np.ndarray
    # [sum(counts), dim] or [sum(counts)] float32.
    values: np.ndarray
    # [sum(counts)] int64 vocabulary ids (sparse), or [0] (token vectors).
    indices: np.ndarray

    def __post_init__(self) -> None:
        total = int(self.counts.sum()) if len(self.counts) else 0
        if len(self.counts) != len(self.request_ids) or len(self.values) != total:
            raise ValueError(
                f"{len(self.values)} entries and {len(self.counts)} counts for {len(self.request_ids)} requests"
            )
        if len(self.indices) not in (0, total):
            raise ValueError(f"{len(self.indices)} indices for {total} entries")

    def split(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """request id -> (values, indices) of its entries (indices empty for token vectors)."""
        ends = np.cumsum(self.counts)
        out = {}
        for request_id, end, count in zip(self.request_ids, ends.tolist(), self.counts.tolist(), strict=True):
            start = end - count
            indices = self.indices[start:end] if len(self.indices) else self.indices
            out[request_id] = (self.values[start:end], indices)
        return out


@dataclass(frozen=True)
class StepOutput:
    """A step's results on the host, in batch order: rows for POOL / SCORE sequences, tokens for SAMPLE ones."""

    row_request_ids: tuple[int, ...]
    # [len(row_request_ids), dim] float32: pooled embeddings or score logits.
    rows: np.ndarray
    sampled_request_ids: tuple[int, ...]
    # [len(sampled_request_ids)] int64: the next token of each.
    tokens: np.ndarray
    # POOL sequences that asked for SPARSE / MULTI_VECTOR outputs.
    sparse: RaggedRows | None = None
    vectors: RaggedRows | None = None

    def sampled(self) -> dict[int, int]:
        return dict(zip(self.sampled_request_ids, self.tokens.tolist(), strict=True))
