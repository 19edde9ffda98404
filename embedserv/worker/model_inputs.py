"""What the input builder gives the model runner for one step (worker/input_builder.py builds it), grouped by
who reads it: the model's forward (tokens, encoder inputs, images), the attention layers (metadata per
KV-cache group, the prefill skip's kept rows), and the heads (pooled or scored rows, sampled rows, per-token
outputs). Device tensors unless named `_cpu`; `[padded]`: the step's token rows, then padding rows up to the
padded count on CPU (models/layers.py; equal to num_tokens elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedserv.attention.metadata import CommonAttentionMetadata
from embedserv.models.heads.pooling import PoolingInputs, TokenInputs
from embedserv.models.lora import AdapterRows
from embedserv.types import SamplingParams
from embedserv.worker.encoder_inputs import EncoderInputs
from embedserv.worker.image_inputs import ImageInputs
from embedserv.worker.prefill_skip import SkipInputs


@dataclass(frozen=True)
class StepTokens:
    """The step's tokens, packed longest first, as the model's forward reads them (models/interface.py)."""

    # [padded] int64: the step's num_tokens token ids, then padding rows (id 0).
    input_ids: torch.Tensor
    # [padded] int64, already shifted by the model's position offset (padding rows: the offset); M-RoPE models
    # (models/interface.py's `mrope`): [3, padded], (temporal, height, width) per row.
    positions: torch.Tensor
    # [padded] int64, or None when every token is type 0 or the model reads no token types.
    token_type_ids: torch.Tensor | None = None
    # [padded] int64: each token's built-in task adapter (-1 for none, and for padding rows); None when no token
    # has one or the model has no such adapters.
    adapter_ids: torch.Tensor | None = None
    # --lora models instead: each adapter's rows (models/lora.py); None when every row runs the base.
    adapter_rows: AdapterRows | None = None


@dataclass(frozen=True)
class RowInputs:
    """What the row head (pooler, score head, a dual encoder's own) reads: POOL / SCORE sequences that yield
    a row, in batch order."""

    pooling: PoolingInputs
    request_ids: tuple[int, ...]
    # Each row's adapter (Sequence.adapter), in the same order: --lora adapters' own heads pick by it.
    adapters: tuple[int, ...]


@dataclass(frozen=True)
class SampleInputs:
    """What the LM head and the sampler read: SAMPLE sequences that yield a token, in batch order."""

    # [num_samples, padded on CPU] int64: the rows whose hidden state predicts the next token (padding: row 0
    # again).
    rows: torch.Tensor
    request_ids: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    # Tokens known when each row samples (the sampler seeds by it).
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class ModelInputs:
    tokens: StepTokens
    # Attention metadata, one per KV-cache group; one KV-free entry when the step keeps no KV.
    attention: tuple[CommonAttentionMetadata, ...]
    # Per KV-cache group, the host copy of the block tables [num_seqs, max_blocks] (empty without KV).
    block_tables_cpu: tuple[np.ndarray, ...] = ()
    # Encoder-decoder steps: the encoder inputs run now; None when no encoder runs.
    encoder: EncoderInputs | None = None
    # Steps with image sequences: their patch rows; None when the step has no image.
    images: ImageInputs | None = None
    # --kv-sharing-fast-prefill (worker/prefill_skip.py): the rows the layers after the last KV writer run;
    # None when every row runs every layer. Row, sample and token outputs then index the kept rows.
    skip: SkipInputs | None = None
    # Rows of the model's output that are real (the step's tokens, or the prefill skip's kept rows); the
    # padding rows after them are dropped before the heads.
    num_output_rows: int | None = None
    # The heads' inputs; None where no sequence of the step wants that output.
    rows: RowInputs | None = None
    samples: SampleInputs | None = None
    # POOL sequences that want a sparse or a per-token output: their tokens.
    sparse_tokens: TokenInputs | None = None
    vector_tokens: TokenInputs | None = None
