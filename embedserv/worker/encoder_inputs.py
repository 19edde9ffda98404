"""The encoder inputs of an encoder-decoder step (worker/input_builder.py): the sequences whose encoder runs now,
packed in the decoder's sequence order with their own offsets, and the KV-free cross-attention metadata."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

import numpy as np

from embedserv.attention.metadata import (
    CommonAttentionMetadata, build_common_metadata, build_cross_metadata, cumulative_offsets,
)
from embedserv.padding import pad


class EncoderPlan:
    """The encoder inputs of the sequences whose encoder runs in this step, in the decoder's packed order."""

    def __init__(self, seqs, order, position_offset: int, padded: Callable[[int], int]) -> None:
        self.num_seqs = len(seqs)
        # Packed positions (index into `order`) of the sequences whose encoder runs.
        self.members = np.fromiter((p for p, i in enumerate(order) if seqs[i].encoder_token_ids), dtype=np.int64)
        member_seqs = [seqs[order[p]] for p in self.members]
        self.lens = np.fromiter((len(s.encoder_token_ids) for s in member_seqs), dtype=np.int64, count=len(member_seqs))
        total = int(self.lens.sum())
        self.cu = cumulative_offsets(self.lens)
        ids = np.fromiter(chain.from_iterable(s.encoder_token_ids for s in member_seqs), dtype=np.int64, count=total)
        positions = np.arange(total, dtype=np.int64) - np.repeat(self.cu[:-1], self.lens)
        self.positions = positions
        rows = padded(total)
        self.parts = [pad(ids, rows), pad(positions, rows) + position_offset, self.cu] if total else []

    def inputs(self, device_parts):
        """(ids, positions, metadata) on the device; all None when no encoder runs."""
        if not len(self.parts):
            return None, None, None
        ids, positions, cu = next(device_parts), next(device_parts), next(device_parts)
        return ids, positions, build_common_metadata(self.lens, False, cu_seqlens=cu)

    def kv_free_cross(self, lens_q, cu_q, encoder_attention) -> CommonAttentionMetadata:
        if len(self.members) != self.num_seqs:
            raise ValueError("a step without a KV cache must run the encoder of every encoder-decoder sequence")
        return build_cross_metadata(lens_q, self.lens, cu_q, encoder_attention.cu_seqlens_q)
