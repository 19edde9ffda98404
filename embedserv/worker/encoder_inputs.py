"""The encoder inputs of an encoder-decoder step (worker/input_builder.py): the sequences whose encoder runs now,
packed in the decoder's sequence order with their own offsets, and the KV-free cross-attention metadata."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from embedserv.attention.metadata import (
    CommonAttentionMetadata,
    build_common_metadata,
    build_cross_metadata,
    cumulative_offsets,
)
from embedserv.models.layers import pad


@dataclass(frozen=True)
class EncoderInputs:
    # [num_encoder_tokens, padded on CPU] int64: the ids of the encoder inputs that run now, packed in the
    # decoder's sequence order, and their positions, shifted by the model's position offset.
    input_ids: torch.Tensor
    positions: torch.Tensor
    # Their metadata: bidirectional, one sequence per encoder input.
    attention: CommonAttentionMetadata
    # KV-free steps: each decoder sequence's queries over its own packed encoder keys. None on paged steps,
    # whose cross-attention reads its KV-cache group.
    cross_attention: CommonAttentionMetadata | None = None


class EncoderPlan:
    """The encoder inputs of the sequences whose encoder runs in this step, in the decoder's packed order."""

    def __init__(self, seqs, order, position_offset: int, padded: Callable[[int], int], parts: dict) -> None:
        """Adds the encoder tokens to the step's host `parts` (input_builder.to_device) when any runs."""
        self.num_seqs = len(seqs)
        # Packed positions (index into `order`) of the sequences whose encoder runs.
        self.members = np.fromiter((p for p, i in enumerate(order) if seqs[i].encoder_token_ids), dtype=np.int64)
        member_seqs = [seqs[order[p]] for p in self.members]
        self.lens = np.fromiter((len(s.encoder_token_ids) for s in member_seqs), dtype=np.int64, count=len(member_seqs))
        total = int(self.lens.sum())
        self.cu = cumulative_offsets(self.lens)
        ids = np.fromiter(chain.from_iterable(s.encoder_token_ids for s in member_seqs), dtype=np.int64, count=total)
        self.positions = np.arange(total, dtype=np.int64) - np.repeat(self.cu[:-1], self.lens)
        self.runs = bool(total)
        if self.runs:
            rows = padded(total)
            parts["encoder_input_ids"] = pad(ids, rows)
            parts["encoder_positions"] = pad(self.positions, rows) + position_offset
            parts["encoder_cu_seqlens"] = self.cu

    def inputs(self, device_parts: dict, paged: bool, lens_q, cu_q) -> EncoderInputs | None:
        """On the device, by their names in the step's copy; None when no encoder runs. `lens_q`, `cu_q`: the
        decoder's queries (a KV-free step's cross-attention reads each sequence's encoder keys)."""
        if not paged and len(self.members) != self.num_seqs:
            raise ValueError("a step without a KV cache must run the encoder of every encoder-decoder sequence")
        if not self.runs:
            return None
        attention = build_common_metadata(self.lens, False, cu_seqlens=device_parts["encoder_cu_seqlens"])
        cross = None if paged else build_cross_metadata(lens_q, self.lens, cu_q, attention.cu_seqlens_q)
        return EncoderInputs(device_parts["encoder_input_ids"], device_parts["encoder_positions"], attention, cross)
