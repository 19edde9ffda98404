"""Attention metadata for a flat, packed batch of sequences.

Every tensor here describes the batch as the input builder packed it: `num_tokens` rows, sequences one
after another, `cu_seqlens` marking where each starts. Backends extend it with what they precompute.

On KV-free paths (embed, rerank, classify) each sequence's queries are its keys. With a paged KV cache a
sequence's queries are its new tokens (a prompt chunk, or one token when decoding) and its keys are all of
its tokens so far: the first `seq_lens_k - seq_lens_q` (its context) are in the cache, in the blocks its
row of `block_tables` lists; the last `seq_lens_q` are this step's, written to `slot_mapping`. A query at
position p of its sequence sees the keys at positions 0..p (causal, aligned at the end: the last query is
the last key). Block tables are built once per step on the host and copied once; no one expands them.

A KV-free step may also have suffix queries (the prefill skip, `build_suffix_metadata`): not cross, no
cache, `seq_lens_q <= seq_lens_k`, q rows packed by `cu_seqlens_q` and k/v rows by `cu_seqlens_k`, each
sequence's queries the last len_q of its len_k positions, as on paged steps, causal or bidirectional.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """What the input builder knows; each backend builds its own metadata from this."""

    # [num_seqs + 1] int32 on the device: token offsets of each query sequence.
    cu_seqlens_q: torch.Tensor
    # [num_seqs + 1] int32 on the device: offsets of each sequence's keys as if packed (equal to q on
    # KV-free paths).
    cu_seqlens_k: torch.Tensor
    # [num_seqs] int64 host copy of the query lengths, for backends that plan on the host.
    seq_lens_q_cpu: np.ndarray
    # [num_seqs] int64 host copy of the key lengths (context + new tokens).
    seq_lens_k_cpu: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    is_causal: bool
    # Paged KV only (all None / 0 on KV-free paths):
    # [num_tokens] int64 on the device: the cache slot (block * block_size + offset) each new token's key
    # and value are written to.
    slot_mapping: torch.Tensor | None = None
    # [num_seqs, max_blocks] int32 on the device: each sequence's block table, padded with 0 (never read:
    # seq_lens_k bounds every read).
    block_tables: torch.Tensor | None = None
    # [num_seqs] int32 on the device: the key lengths again, for kernels that take them (seqused_k).
    seq_lens_k: torch.Tensor | None = None
    # Tokens per KV-cache block.
    block_size: int = 0
    # Cross-attention: queries are decoder tokens and keys another sequence's (the encoder's): never
    # causal, len_q and len_k unrelated. KV-free, k/v rows are packed by cu_seqlens_k. Paged, k/v (when
    # given) are this step's encoder tokens, written to slot_mapping ([num_encoder_tokens], maybe
    # empty), and every key is read from the cache through block_tables (the cross tables).
    cross: bool = False
    # Derived from the fields above when the record is made (every layer reads them, every call):
    # paged KV (a slot mapping);
    reads_kv_cache: bool = field(init=False)
    # rows of q that belong to sequences (q may carry padding rows after them: models/layers.py);
    num_query_rows: int = field(init=False)
    # rows of this step's k and v that belong to sequences (padding rows may follow): the new tokens written
    # to the cache (slot_mapping), or, KV-free, every key;
    num_key_rows: int = field(init=False)
    # KV-free self-attention whose queries are the last tokens of their sequences, not all of them (the
    # prefill skip): keys are packed by cu_seqlens_k apart from the queries.
    suffix_queries: bool = field(init=False)

    def __post_init__(self) -> None:
        reads_kv_cache = self.slot_mapping is not None
        queries, keys = self.seq_lens_q_cpu, self.seq_lens_k_cpu
        num_query_rows = int(queries.sum())
        # Queries that are their own keys (build_common_metadata) have one set of lengths.
        own_keys = keys is queries
        if reads_kv_cache:
            num_key_rows = self.slot_mapping.shape[0]
        elif own_keys:
            num_key_rows = num_query_rows
        else:
            num_key_rows = int(keys.sum())
        object.__setattr__(self, "reads_kv_cache", reads_kv_cache)
        object.__setattr__(self, "num_query_rows", num_query_rows)
        object.__setattr__(self, "num_key_rows", num_key_rows)
        apart = not own_keys and not np.array_equal(queries, keys)
        object.__setattr__(self, "suffix_queries", not self.cross and not reads_kv_cache and apart)

    @property
    def context_lens_cpu(self) -> np.ndarray:
        """[num_seqs] tokens of each sequence already in the cache before this step."""
        return self.seq_lens_k_cpu - self.seq_lens_q_cpu


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


def ranges(counts: np.ndarray) -> np.ndarray:
    """[n] counts -> concatenated aranges, int64: 0..counts[0]-1, 0..counts[1]-1, ..."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


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


def build_cross_metadata(
    seq_lens_q: np.ndarray, seq_lens_k: np.ndarray, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> CommonAttentionMetadata:
    """KV-free cross-attention: each sequence's decoder queries over its own packed encoder keys."""
    return _packed_apart(seq_lens_q, seq_lens_k, cu_seqlens_q, cu_seqlens_k, is_causal=False, cross=True)


def build_suffix_metadata(
    seq_lens_q: np.ndarray,
    seq_lens_k: np.ndarray,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    is_causal: bool,
) -> CommonAttentionMetadata:
    """KV-free queries that are the last seq_lens_q of their sequence's seq_lens_k keys (the prefill skip's
    last layers: the kept rows over every token's keys)."""
    return _packed_apart(seq_lens_q, seq_lens_k, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, cross=False)


def _packed_apart(seq_lens_q, seq_lens_k, cu_seqlens_q, cu_seqlens_k, is_causal: bool, cross: bool):
    """KV-free metadata whose q and k rows are packed apart, by their own offsets."""
    return CommonAttentionMetadata(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        seq_lens_q_cpu=np.asarray(seq_lens_q, dtype=np.int64),
        seq_lens_k_cpu=np.asarray(seq_lens_k, dtype=np.int64),
        max_seqlen_q=int(np.max(seq_lens_q)) if len(seq_lens_q) else 0,
        max_seqlen_k=int(np.max(seq_lens_k)) if len(seq_lens_k) else 0,
        is_causal=is_causal,
        cross=cross,
    )


def build_paged_metadata(
    seq_lens_q: np.ndarray,
    seq_lens_k: np.ndarray,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k_device: torch.Tensor,
    block_size: int,
    cross: bool = False,
) -> CommonAttentionMetadata:
    """Metadata for a step over the paged KV cache: causal queries over their sequence's keys, or (cross)
    queries over every key of their cross table."""
    return CommonAttentionMetadata(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        seq_lens_q_cpu=seq_lens_q,
        seq_lens_k_cpu=seq_lens_k,
        max_seqlen_q=int(seq_lens_q.max()),
        max_seqlen_k=int(seq_lens_k.max()),
        is_causal=not cross,
        slot_mapping=slot_mapping,
        block_tables=block_tables.to(torch.int32),
        seq_lens_k=seq_lens_k_device.to(torch.int32),
        block_size=block_size,
        cross=cross,
    )
