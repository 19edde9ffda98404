"""FlexAttention over a paged KV cache: the block mask of a step, planned on the host and built on the device.

With a paged KV cache the key sequence is the whole physical cache, read in place: a KV block of the
BlockMask is one cache block (any block size), each query block visits the blocks its sequences' block
tables list, and the mask_mod maps a slot to its sequence's logical position through small per-step
lookups. Nothing is gathered. The BlockMask depends on the cache's block count, which the metadata does
not carry, so it is built on a step's first paged layer and kept for the others.

Compiled on CPU this reads the cache correctly at any block size (16, 12, 256 checked); compiled on
CUDA a block is a multiple of 16 tokens, since the kernel's key tiles must not span blocks. Visiting
16-token blocks costs more than the 128-token tiles of a gathered, packed batch: about 1.5-2.5x the
time of the former gather-based path in float32 (sdpa, the CPU default, is faster than either).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from embedserv.attention.backends.flex_masks import BLOCK_SIZE, ordered_blocks, padded_size
from embedserv.attention.metadata import CommonAttentionMetadata, ranges


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
    # Host, for windowed layers, whose BlockMask visits only the blocks in reach: [5, n] int64, every
    # entry (query block, sequence, logical block) with the first and last position of that sequence's
    # queries in that query block; [n] bool, whether the query block holds that sequence only.
    spans_cpu: np.ndarray
    single_cpu: np.ndarray
    # (BlockMask, [num_blocks] logical index of each physical block) per cache size (num_blocks) and
    # window: the cache is not known until the first layer runs.
    masks: dict = field(default_factory=dict, compare=False)


def plan_paged(common: CommonAttentionMetadata) -> _PagedPlan:
    lens_q, lens_k, size = common.seq_lens_q_cpu, common.seq_lens_k_cpu, common.block_size
    num_tokens = int(lens_q.sum())
    q_size = padded_size(num_tokens)
    seqs = np.arange(len(lens_q))
    q_seq = np.zeros(q_size, dtype=np.int64)
    q_seq[:num_tokens] = np.repeat(seqs, lens_q)
    q_pos = np.full(q_size, -1, dtype=np.int64)
    q_pos[:num_tokens] = ranges(lens_q) + np.repeat(lens_k - lens_q, lens_q)
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
    pair_seq = first_seq[pair_qb] + ranges(last_seq - first_seq + 1)
    entry_qb, entry_seq = np.repeat(pair_qb, blocks[pair_seq]), np.repeat(pair_seq, blocks[pair_seq])
    entry_logical = ranges(blocks[pair_seq])
    # Whole: the query block holds one sequence (padding rows are discarded) and the cache block ends at
    # or before its first query's limit (positions grow along a sequence; a cross limit is the sequence's).
    single = (first_seq == last_seq)[entry_qb]
    full = single & ((entry_logical + 1) * size - 1 <= q_limit[firsts][entry_qb])
    # The entry's sequence's rows in its query block, for windowed layers.
    starts_q = np.cumsum(lens_q) - lens_q
    row_lo = np.maximum(firsts[entry_qb], starts_q[entry_seq])
    row_hi = np.minimum(lasts[entry_qb], starts_q[entry_seq] + lens_q[entry_seq] - 1)
    spans = np.stack((entry_qb, entry_seq, entry_logical, q_pos[row_lo], q_pos[row_hi]))
    entries = spans[:3]
    device = common.block_tables.device
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    q_pos_t = to(q_pos)
    return _PagedPlan(
        q_start=to(q_start),
        q_pos=q_pos_t,
        q_limit=q_pos_t if q_limit is q_pos else to(q_limit),
        owned=to(np.stack((np.repeat(seqs, blocks), ranges(blocks)))),
        partial=to(entries[:, ~full]),
        full=to(entries[:, full]),
        spans_cpu=spans,
        single_cpu=single,
    )


def _window_entries(plan: _PagedPlan, size: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The [3, n] partial and full entries of a causal layer with `window`: the cache blocks with a key
    that some query of the query block sees (none after its last query, none `window` or more before its
    first), whole where every query of it sees every key of the block."""
    logical, lo, hi = plan.spans_cpu[2:]
    start, end = logical * size, logical * size + size - 1
    some = (start <= hi) & (end > lo - window)
    full = plan.single_cpu & (end <= lo) & (start > hi - window)
    return plan.spans_cpu[:3, some & ~full], plan.spans_cpu[:3, full]


def paged_block_mask(
    plan: _PagedPlan, common: CommonAttentionMetadata, num_blocks: int, window: int | None = None
) -> tuple[BlockMask, torch.Tensor]:
    """The BlockMask over a cache of `num_blocks` blocks, and the logical index of each physical block
    (for the bias score_mod): device ops only (but a windowed layer's entries), once per step, cache
    size and window."""
    size, tables = common.block_size, common.block_tables
    partial, full = plan.partial, plan.full
    window_t = None
    if window is not None:
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(tables.device)  # noqa: E731
        partial, full = map(to, _window_entries(plan, size, window))
        # An input of the compiled kernel, not a constant: a new window value compiles nothing.
        window_t = torch.tensor(window, device=tables.device)
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
        return ordered_blocks(visits)

    q_start, q_pos, q_limit = plan.q_start, plan.q_pos, plan.q_limit

    def paged_mask(b, h, q, kv):
        block = kv // size
        index = logical[block]
        # The slot's block is the query's own sequence's block at that index, and not past the query's
        # limit (an index past the sequence's blocks reads another's entry or the padding: the limit, at
        # most the sequence's last key, rules it out). Causal and cross differ only in the limit.
        own = flat[(q_start[q] + index).clamp(max=length - 1)]
        key_pos = index * size + kv % size
        seen = (own == block) & (key_pos <= q_limit[q])
        if window_t is not None:
            seen = seen & (q_pos[q] - key_pos < window_t)
        return seen

    block_mask = BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=(BLOCK_SIZE, size),
        mask_mod=paged_mask,
        seq_lengths=(plan.q_pos.shape[0], num_blocks * size),
        compute_q_blocks=False,
    )
    return block_mask, logical
