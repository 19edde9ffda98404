"""Decode attention on CPU: one query per sequence over its keys in the paged cache, read through block tables.

A decode step is bound by memory: every key and value of every sequence is read once per layer, for a few
multiply-adds each (128 streams of ~150 tokens of a 256-wide model: 19 MB of keys and 19 MB of values a
layer). SDPA's flash kernel wants keys and values gathered and padded first, so the step copied both and
then read them again, and its one-row queries ran at a fraction of the bandwidth (a 2-layer model at 128
streams: 8.8 of 17.7 ms a step under the profiler in gathers and SDPA). In float32 this does instead:
- keys: one gather of whole blocks (one index per block), then one batched matmul of every query head
  with every KV head of each gathered token, contiguous, keeping the diagonal (kv_heads times the
  needed multiply-adds, heads / 4 per byte of keys, which cost less than the copy a per-head layout
  would need up to MAX_HEADS query heads; beyond, SDPA runs instead);
- values: never gathered. F.embedding_bag sums each (sequence, head)'s value rows weighted by its
  probabilities straight out of the cache, reading each value once. Its row indices (one per key per
  head: the block table spelled out per token) are made once per step and shared by all layers of the
  KV group (`value_rows`).
Measured in one thread over two layers' caches of that shape: 12-14 ms (gathers and SDPA) -> 9 ms. Key
slots past a sequence's length (the end of its last block, the padding of the tables) are read and get
probability 0: the cache zeroes fresh blocks, so what they hold is finite.

In bfloat16 the probabilities cannot be embedding_bag's weights without rounding them: there keys and
values are gathered and attention runs as two float32 matmuls (decode_with_matmuls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The gathered score matmul does heads / 4 multiply-adds per byte of keys. Against SDPA at 2 threads
# (32 decodes of 500 keys, head size 64 unless said): 4 heads 1.3 vs 1.7 ms, 9 of 3 KV heads 1.2 vs 1.5,
# 14 of 2 1.0 vs 1.5, 16 of 4 2.5 vs 2.8, 16 of 16 9.8 vs 10.6, 32 of 32 even, 32 of 8 (size 128) 6.8 vs
# 5.1: past this many query heads SDPA runs.
MAX_HEADS = 16


def uses_gathered_decode(q: torch.Tensor) -> bool:
    """q: [n, heads, head_size]."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[1] <= MAX_HEADS


def value_rows(tables: torch.Tensor, block_size: int, heads: int, kv_heads: int) -> torch.Tensor:
    """[n * heads, blocks * block_size] int64: for each decode, query head and key position, the row of
    `kv_cache[1].view(-1, head_size)` holding that key's value for the head's KV head. tables: [n, blocks]."""
    n = tables.shape[0]
    offsets = torch.arange(block_size, device=tables.device)
    slots = (tables.long()[:, :, None] * block_size + offsets).view(n, 1, -1)
    kv_head = torch.arange(heads, device=tables.device) // (heads // kv_heads)
    return (slots * kv_heads + kv_head[None, :, None]).view(n * heads, -1)


def decode_gathered(
    q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, heads, d] over the keys of `tables` [n, blocks] -> [n, heads, d]. `rows`: value_rows of the
    same tables. `mask`: [n, 1, 1, L] bool (True for the keys a query sees) or [n, heads, 1, L] float added
    to the scores, L = blocks * block_size."""
    n, heads, size = q.shape
    kv_heads = kv_cache.shape[-2]
    keys = kv_cache[0].index_select(0, tables.reshape(-1))  # [n * blocks, block_size, kv_heads, d]
    length = rows.shape[1]
    # [n, heads, L * kv_heads]: every query head against every KV head of every key. This orientation
    # runs on both threads of a 2-core machine; keys @ q.T ran on one (2.5 against 4.9 ms, two layers).
    every = torch.bmm(q, keys.view(n, length * kv_heads, size).transpose(1, 2))
    # Query head h = k * group + j reads KV head k: the diagonal of (k, KV head) -> [n, group, L, kv_heads].
    mine = every.view(n, kv_heads, heads // kv_heads, length, kv_heads).diagonal(dim1=1, dim2=4)
    scores = mine.permute(0, 3, 1, 2).reshape(n, heads, 1, length).mul_(scale)
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask)
    probs = scores.softmax(dim=-1).view(n * heads, length)
    out = F.embedding_bag(rows, kv_cache[1].view(-1, size), mode="sum", per_sample_weights=probs)
    return out.view(n, heads, size)


def decode_with_matmuls(q, keys, values, mask, scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls in float32: q [n, H, d], keys/values [n, L, kv_heads, d]
    -> [n, H, d]. On CPU in bfloat16, SDPA's flash kernel spent half of a decode step on these one-row
    queries, about 4x this (32 streams of a 30-layer model: 115 -> 55 ms a step); in float32 SDPA is the
    faster. Query heads are grouped by the KV head they share, so grouped-query attention repeats nothing.
    `mask`: [n, 1, 1, L] bool (True for the keys a query sees), or [n, H, 1, L] float32 added to the scores."""
    n, heads, size = q.shape
    kv_heads = keys.shape[2]
    grouped = q.float().view(n, kv_heads, heads // kv_heads, size)
    scores = torch.matmul(grouped, keys.float().permute(0, 2, 3, 1)).mul_(scale)  # [n, kv_heads, group, L]
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask.view(n, 1, 1, -1), float("-inf"))
    else:
        scores.add_(mask.view(n, kv_heads, heads // kv_heads, -1))
    out = torch.matmul(scores.softmax(dim=-1), values.float().transpose(1, 2))  # [n, kv_heads, group, d]
    return out.view(n, heads, size).to(q.dtype)
