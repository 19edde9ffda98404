"""FlexAttention over the packed batch with a document mask, compiled.

The whole batch is one sequence to FlexAttention; the mask lets a token see only the tokens of its own
sequence (and, when causal, none after it). The block mask is built once per batch from `cu_seqlens` with
a few tensor ops and shared by every layer; FlexAttention skips the blocks it rules out.

The kernel is compiled, on CPU (C++) as on CUDA (Triton): eager FlexAttention materializes the whole
[num_tokens, num_tokens] score matrix, which never pays. Shapes are static: the batch is padded to a
power of two of at least one block, so a model compiles one kernel per size class (warm-up runs them).
Dynamic-shape compilation would avoid the padding, but the CPU template fails to build for some sizes
in torch 2.13.

With a paged KV cache the key sequence is the whole physical cache, read in place: a KV block of the
BlockMask is one cache block (any block size), each query block visits the blocks its sequences' block
tables list, and the mask_mod maps a slot to its sequence's logical position through small per-step
lookups. Nothing is gathered. The BlockMask depends on the cache's block count, which the metadata does
not carry, so it is built on a step's first paged layer and kept for the others.

Compiled on CPU this reads the cache correctly at any block size (16, 12, 256 checked); compiled on
CUDA a block is a multiple of 16 tokens, since the kernel's key tiles must not span blocks. Visiting
16-token blocks costs more than the 128-token tiles of a gathered, packed batch: about 1.5-2.5x the
time of the former gather-based path in float32 (sdpa, the CPU default, is faster than either).

Cross-attention: KV-free, queries and keys are packed apart (each padded to its own size class) and the
document mask compares a query's sequence with a key's; paged, the mask_mod is the same as for
self-attention with each query's limit the last key of its sequence (its encoder length - 1) instead of
its own position. T5's relative position bias is a score_mod that indexes the step's distance table by
the clamped distance between a key's position and the query's; the table and positions are inputs of the
compiled kernel, so a new step compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from embedserv.attention.backends.base import PagedBackendBase, relative_bias_table, step_memo, write_kv
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

BLOCK_SIZE = 128
# On CUDA the Triton kernel tiles the keys BLOCK_N at a time; a tile must lie inside one cache block, and
# Triton's matrix product needs tiles of at least 16 keys. Cache blocks are then a multiple of 16 tokens.
_CUDA_TILE = 16
_CUDA_MAX_TILE = 64


@dataclass(frozen=True)
class _PagedPlan:
    """The paged block mask's per-step parts that do not depend on the cache's size, planned on the host.

    The keys FlexAttention sees are the whole physical cache, [num_blocks * block_size] slots; a KV block
    of the BlockMask is one cache block. Which blocks each query block visits comes from the block tables;
    which slots each query sees (the mask_mod) from small lookups: a query row's position and where its
    sequence's blocks start in the list of every sequence's blocks, and a physical block's logical index.
    Every lookup has a shape fixed by the query size class and the cache (never by the number of
    sequences or the table width), so the compiled kernel is not recompiled step after step."""

    # [q_size] int64: where each query row's sequence starts in `owned`, the row's position in its
    # sequence, and the last key position it sees: its own (causal) or its sequence's last (cross; the
    # same tensor as q_pos when causal). Padding rows: 0, -1, -1: they see nothing.
    q_start: torch.Tensor
    q_pos: torch.Tensor
    q_limit: torch.Tensor
    # [2, num_owned] int64: every block a sequence reads, as (sequence, logical block), sequence by sequence.
    owned: torch.Tensor
    # [3, n] int64: (query block, sequence, logical block) the kernel visits with the mask_mod (partial),
    # and those every query of the query block sees whole (full: one sequence, blocks before its queries).
    partial: torch.Tensor
    full: torch.Tensor
    # (BlockMask, [num_blocks] logical index of each physical block) per cache size (num_blocks): the
    # cache is not known until the first layer runs.
    masks: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class FlexMetadata(AttentionMetadata):
    # KV-free: the document mask over the packed batch; None on paged steps (built per cache size).
    block_mask: BlockMask | None
    # Tokens the batch (its queries) is padded to: a power of two, at least BLOCK_SIZE.
    padded_tokens: int
    paged: _PagedPlan | None = None
    # KV-free: [padded_tokens] int32, each query row's sequence (padding rows: num_seqs).
    documents: torch.Tensor | None = None
    # KV-free: keys are padded to this many rows (padded_tokens, but for cross-attention).
    padded_keys: int = 0
    # What a step's layers share and only the first that needs it makes (the bias table, positions).
    memo: dict = field(default_factory=dict, compare=False, repr=False)


# Every (dtype, heads, head size, mask kind, score_mod (T5's bias or none), padded size) a process runs
# is one compiled entry of flex_attention; torch gives a function 8 before it silently falls back to eager
# FlexAttention, which materializes the whole score matrix (100-1000x slower). Two models with nine size
# classes each fit in 64. (KV-free cross-attention pads keys to their own size class: monoT5's queries
# stay in the first, BART's match their keys, so it adds about one entry per key size class.)
_RECOMPILE_LIMIT = 64


@lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo.config as dynamo_config

    # `cache_size_limit` before torch 2.6.
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        # Past the limit, eager FlexAttention over a paged step would score every query against the whole
        # cache (gigabytes, minutes): fail the step loudly instead.
        dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


def padded_size(num_tokens: int) -> int:
    return max(BLOCK_SIZE, 1 << (num_tokens - 1).bit_length())


def document_mask_mod(doc: torch.Tensor, is_causal: bool, doc_k: torch.Tensor | None = None):
    """mask_mod: True where query token q may attend to key token kv (same sequence, not later if causal).
    `doc_k`: the keys' sequences where they are packed apart from the queries (cross, never causal)."""
    if doc_k is not None:
        def cross_document(b, h, q, kv):
            return doc[q] == doc_k[kv]

        return cross_document
    if is_causal:
        def causal_document(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        return causal_document

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    return document


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> per query block, how many key blocks are set and their indices first."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def document_block_mask(
    doc: torch.Tensor, num_seqs: int, is_causal: bool, doc_k: torch.Tensor | None = None
) -> BlockMask:
    """The BlockMask of the document mask, from block-level document ranges (no per-token vmap).

    `doc` is non-decreasing, so a block holds the documents first..last: two blocks interact when their
    ranges overlap, and every token pair interacts (a "full" block, no mask_mod call) when both blocks
    lie in one and the same document. Blocks of padding only (document `num_seqs`) are left out: their
    rows are discarded, and attending padding to padding would cost up to as much as the real batch.
    `doc_k`: the keys' documents, for cross-attention (keys packed apart, never causal).
    """
    keys = doc if doc_k is None else doc_k
    q_blocks, k_blocks = doc.view(-1, BLOCK_SIZE), keys.view(-1, BLOCK_SIZE)
    first, last = q_blocks[:, 0], q_blocks[:, -1]
    first_k, last_k = k_blocks[:, 0], k_blocks[:, -1]
    real = first < num_seqs
    partial = (first[:, None] <= last_k[None, :]) & (first_k[None, :] <= last[:, None]) & real[:, None]
    full = (
        (first == last)[:, None] & (first_k == last_k)[None, :] & (first[:, None] == first_k[None, :]) & real[:, None]
    )
    if is_causal:
        below = torch.ones_like(partial).tril_()
        partial &= below
        full &= below.tril_(-1)
    partial &= ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=document_mask_mod(doc, is_causal, doc_k), seq_lengths=(doc.shape[0], keys.shape[0]),
    )


def relative_bias_mod(table: torch.Tensor, max_distance: int, q_pos: torch.Tensor, key_position):
    """score_mod adding T5's bias: table[h, clamp(key - query position, -M, M) + M]. `key_position(kv)`
    maps a key index to its position in its sequence (packed rows or paged cache slots)."""

    def biased(score, b, h, q, kv):
        distance = (key_position(kv) - q_pos[q]).clamp(-max_distance, max_distance)
        return score + table[h, distance + max_distance]

    return biased


class FlexBackend(PagedBackendBase):
    name = "flex"

    def __init__(self, compile: bool = True) -> None:
        # compile=False runs FlexAttention eagerly: same function, full score matrix; tests use it to
        # cover many shapes without compiling each.
        self.compile = compile

    def block_size_multiple_on(self, device: torch.device) -> int:
        return _CUDA_TILE if self.compile and device.type == "cuda" else 1

    def build_metadata(self, common: CommonAttentionMetadata) -> FlexMetadata:
        if common.reads_kv_cache:
            plan = plan_paged(common)
            return FlexMetadata(common=common, block_mask=None, padded_tokens=plan.q_pos.shape[0], paged=plan)
        size = padded_size(int(common.seq_lens_q_cpu.sum()))
        doc = _documents(common.cu_seqlens_q, size)
        num_seqs = len(common.seq_lens_q_cpu)
        if common.cross:
            key_size = padded_size(int(common.seq_lens_k_cpu.sum()))
            doc_k = _documents(common.cu_seqlens_k, key_size)
            block_mask = document_block_mask(doc, num_seqs, False, doc_k)
        else:
            key_size = size
            block_mask = document_block_mask(doc, num_seqs, common.is_causal)
        return FlexMetadata(
            common=common, block_mask=block_mask, padded_tokens=size, documents=doc, padded_keys=key_size
        )

    def forward(self, layer, q, k, v, kv_cache, meta: FlexMetadata) -> torch.Tensor:
        attend = _compiled_flex() if self.compile else flex_attention
        if kv_cache is not None:
            return _forward_paged(attend, layer, q, k, v, kv_cache, meta)
        out = attend(
            _batch(q, meta.padded_tokens), _batch(k, meta.padded_keys), _batch(v, meta.padded_keys),
            score_mod=_packed_bias_mod(layer, meta), block_mask=meta.block_mask, scale=layer.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0, :, : q.shape[0]].transpose(0, 1)


def _packed_bias_mod(layer, meta: FlexMetadata):
    """KV-free self-attention's bias score_mod (queries are their own keys), or None without a bias."""
    table = relative_bias_table(layer, meta.memo)
    if table is None:
        return None
    if meta.common.cross:
        raise ValueError("cross-attention takes no relative position bias")

    def positions() -> torch.Tensor:
        # Each packed row's position in its sequence; padding rows get rows past the end (never seen).
        cu = meta.common.cu_seqlens_q.long()
        rows = torch.arange(meta.padded_tokens, device=cu.device)
        return rows - cu[meta.documents.long()]

    pos = step_memo(meta.memo, "positions", positions)
    return relative_bias_mod(table, layer.relative_bias.max_distance, pos, lambda kv: pos[kv])


def _batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """[n, heads, d] -> [1, heads, size, d], padded with zeros."""
    return F.pad(x, (0, 0, 0, 0, 0, size - x.shape[0])).transpose(0, 1).unsqueeze(0)


def _forward_paged(attend, layer, q, k, v, kv_cache, meta: FlexMetadata) -> torch.Tensor:
    """Queries over the whole physical cache as one key sequence, through the paged block mask."""
    common, plan = meta.common, meta.paged
    write_kv(k, v, kv_cache, common)
    _, num_blocks, size, kv_heads, head_size = kv_cache.shape
    block_mask, logical = step_memo(plan.masks, num_blocks, lambda: paged_block_mask(plan, common, num_blocks))
    score_mod = None
    table = relative_bias_table(layer, meta.memo)
    if table is not None:
        score_mod = relative_bias_mod(
            table, layer.relative_bias.max_distance, plan.q_pos, lambda kv: logical[kv // size] * size + kv % size
        )
    keys = kv_cache[0].view(num_blocks * size, kv_heads, head_size).transpose(0, 1).unsqueeze(0)
    values = kv_cache[1].view(num_blocks * size, kv_heads, head_size).transpose(0, 1).unsqueeze(0)
    # The kernel's default key tile (64 or 128) would span cache blocks; the largest power of two that
    # divides the block size, at most 64, keeps each tile in one block.
    options = {"BLOCK_N": min(size & -size, _CUDA_MAX_TILE)} if q.is_cuda else None
    out = attend(
        _batch(q, meta.padded_tokens), keys, values,
        score_mod=score_mod, block_mask=block_mask, scale=layer.scale, enable_gqa=q.shape[1] != kv_heads,
        kernel_options=options,
    )
    return out[0, :, : q.shape[0]].transpose(0, 1)


def _documents(cu: torch.Tensor, size: int) -> torch.Tensor:
    """[size] the sequence of each packed row; padding rows past the last offset get num_seqs."""
    rows = torch.arange(size, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[n] counts -> concatenated aranges: 0..counts[0]-1, 0..counts[1]-1, ..."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def plan_paged(common: CommonAttentionMetadata) -> _PagedPlan:
    lens_q, lens_k, size = common.seq_lens_q_cpu, common.seq_lens_k_cpu, common.block_size
    num_tokens = int(lens_q.sum())
    q_size = padded_size(num_tokens)
    seqs = np.arange(len(lens_q))
    q_seq = np.zeros(q_size, dtype=np.int64)
    q_seq[:num_tokens] = np.repeat(seqs, lens_q)
    q_pos = np.full(q_size, -1, dtype=np.int64)
    q_pos[:num_tokens] = _ranges(lens_q) + np.repeat(lens_k - lens_q, lens_q)
    q_limit = q_pos
    if common.cross:
        q_limit = np.full(q_size, -1, dtype=np.int64)
        q_limit[:num_tokens] = np.repeat(lens_k - 1, lens_q)
    blocks = -(-lens_k // size)
    q_start = np.zeros(q_size, dtype=np.int64)
    q_start[:num_tokens] = np.repeat(np.cumsum(blocks) - blocks, lens_q)
    # Query block qb holds rows [qb * BLOCK_SIZE, ...): the sequences of its first and last real rows
    # and all between overlap it.
    firsts = np.arange(0, num_tokens, BLOCK_SIZE)
    lasts = np.minimum(firsts + BLOCK_SIZE, num_tokens) - 1
    first_seq, last_seq = q_seq[firsts], q_seq[lasts]
    pair_qb = np.repeat(np.arange(len(firsts)), last_seq - first_seq + 1)
    pair_seq = first_seq[pair_qb] + _ranges(last_seq - first_seq + 1)
    entry_qb, entry_seq = np.repeat(pair_qb, blocks[pair_seq]), np.repeat(pair_seq, blocks[pair_seq])
    entry_logical = _ranges(blocks[pair_seq])
    # Whole: the query block holds one sequence (padding rows are discarded) and the cache block ends at
    # or before its first query's limit (positions grow along a sequence; a cross limit is the sequence's).
    full = (first_seq == last_seq)[entry_qb] & ((entry_logical + 1) * size - 1 <= q_limit[firsts][entry_qb])
    entries = np.stack((entry_qb, entry_seq, entry_logical))
    device = common.block_tables.device
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    q_pos_t = to(q_pos)
    return _PagedPlan(
        q_start=to(q_start), q_pos=q_pos_t, q_limit=q_pos_t if q_limit is q_pos else to(q_limit),
        owned=to(np.stack((np.repeat(seqs, blocks), _ranges(blocks)))),
        partial=to(entries[:, ~full]), full=to(entries[:, full]),
    )


def paged_block_mask(
    plan: _PagedPlan, common: CommonAttentionMetadata, num_blocks: int
) -> tuple[BlockMask, torch.Tensor]:
    """The BlockMask over a cache of `num_blocks` blocks, and the logical index of each physical block
    (for the bias score_mod): device ops only, once per step and cache size."""
    size, tables = common.block_size, common.block_tables
    physical = tables[plan.owned[0], plan.owned[1]].long()
    # A block shared through prefix caching sits at the same logical index in every table that lists it.
    logical = torch.zeros(num_blocks, dtype=torch.int64, device=tables.device)
    logical.index_put_((physical,), plan.owned[1])
    # Every sequence's blocks in one list, padded to a fixed length: the cache's block count, unless
    # prefix caching lists shared blocks more often than that (then a power of two).
    total = plan.owned.shape[1]
    length = num_blocks if total <= num_blocks else 1 << (total - 1).bit_length()
    flat = torch.full((length,), -1, dtype=torch.int64, device=tables.device)
    flat[:total] = physical
    q_blocks = plan.q_pos.shape[0] // BLOCK_SIZE

    def ordered(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Dense [query block, cache block] first, so that a shared block is listed (and visited) once.
        visits = torch.zeros(q_blocks, num_blocks, dtype=torch.bool, device=tables.device)
        visits[entries[0], tables[entries[1], entries[2]].long()] = True
        return _ordered(visits)

    q_start, q_limit = plan.q_start, plan.q_limit

    def paged_mask(b, h, q, kv):
        block = kv // size
        index = logical[block]
        # The slot's block is the query's own sequence's block at that index, and not past the query's
        # limit (an index past the sequence's blocks reads another's entry or the padding: the limit, at
        # most the sequence's last key, rules it out). Causal and cross differ only in the limit.
        own = flat[(q_start[q] + index).clamp(max=length - 1)]
        return (own == block) & (index * size + kv % size <= q_limit[q])

    block_mask = BlockMask.from_kv_blocks(
        *ordered(plan.partial), *ordered(plan.full), BLOCK_SIZE=(BLOCK_SIZE, size), mask_mod=paged_mask,
        seq_lengths=(plan.q_pos.shape[0], num_blocks * size), compute_q_blocks=False,
    )
    return block_mask, logical
