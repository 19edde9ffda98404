"""Attention metadata for a flat, packed batch of sequences.

Every tensor here describes the batch as the input builder packed it: `num_tokens` rows, sequences one
after another, `cu_seqlens` marking where each starts. Backends extend it with what they precompute.

On KV-free paths (embed, rerank, classify) each sequence's queries are its keys. In generation a
sequence's queries are its new tokens (a prompt chunk, or one token when decoding) and its keys are all
of its tokens so far, read from the paged KV cache: `slot_mapping` says where the new keys are written,
`key_slots` where every key of the step is read, in `cu_seqlens_k` order. A query at position p of its
sequence sees the keys at positions 0..p (causal, aligned at the end: the last query is the last key).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """What the input builder knows; each backend builds its own metadata from this."""

    # [num_seqs + 1] int32 on the device: token offsets of each query sequence.
    cu_seqlens_q: torch.Tensor
    # [num_seqs + 1] int32 on the device: key offsets (equal to q on KV-free paths).
    cu_seqlens_k: torch.Tensor
    # [num_seqs] int64 host copy of the query lengths, for backends that plan on the host.
    seq_lens_q_cpu: np.ndarray
    # [num_seqs] int64 host copy of the key lengths.
    seq_lens_k_cpu: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    is_causal: bool
    # [num_tokens] int64 on the device: the KV cache slot (block * block_size + offset) each new token's
    # key and value are written to. None on KV-free paths.
    slot_mapping: torch.Tensor | None = None
    # [sum(seq_lens_k)] int64 on the device: the cache slot of every key each sequence attends to, packed
    # like `cu_seqlens_k` (the block tables, expanded). None on KV-free paths.
    key_slots: torch.Tensor | None = None

    @property
    def reads_kv_cache(self) -> bool:
        return self.slot_mapping is not None


@dataclass(frozen=True)
class AttentionMetadata:
    """Base of every backend's metadata: the common part, passed through unchanged."""

    common: CommonAttentionMetadata

    @property
    def is_causal(self) -> bool:
        return self.common.is_causal


def cumulative_offsets(seq_lens: np.ndarray) -> np.ndarray:
    """[n] lengths -> [n + 1] int64 offsets starting at 0."""
    cu = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=cu[1:])
    return cu


def build_common_metadata(
    seq_lens: np.ndarray, is_causal: bool, cu_seqlens: torch.Tensor | None = None
) -> CommonAttentionMetadata:
    """Metadata for a KV-free batch (queries are their own keys).

    `cu_seqlens` is the device copy when the caller already moved it (the input builder copies all of a
    batch's integers at once); without it a CPU tensor is made here.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    cu_t = cu_seqlens if cu_seqlens is not None else torch.from_numpy(cumulative_offsets(seq_lens))
    cu_t = cu_t.to(torch.int32)
    max_len = int(seq_lens.max()) if len(seq_lens) else 0
    return CommonAttentionMetadata(
        cu_seqlens_q=cu_t,
        cu_seqlens_k=cu_t,
        seq_lens_q_cpu=seq_lens,
        seq_lens_k_cpu=seq_lens,
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
        is_causal=is_causal,
    )


def build_paged_metadata(
    seq_lens_q: np.ndarray,
    seq_lens_k: np.ndarray,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_slots: torch.Tensor,
) -> CommonAttentionMetadata:
    """Metadata for a generation step: causal queries over keys read from the paged KV cache."""
    return CommonAttentionMetadata(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        seq_lens_q_cpu=seq_lens_q,
        seq_lens_k_cpu=seq_lens_k,
        max_seqlen_q=int(seq_lens_q.max()),
        max_seqlen_k=int(seq_lens_k.max()),
        is_causal=True,
        slot_mapping=slot_mapping,
        key_slots=key_slots,
    )
