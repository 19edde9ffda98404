"""Sliding-window and suffix-query masks for the sdpa backend: bool, True where a query sees a key.

Each is made by the step's first layer that needs it and kept in the step's metadata (base.step_memo),
keyed by the window, for the step's other layers: a model's windowed and full layers share a step. A layer
without a window (or whose window no sequence outgrows) takes none of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedserv.attention.backends.base import step_memo
from embedserv.attention.backends.sdpa_runs import SdpaMetadata
from embedserv.attention.backends.windows import in_window, visible_keys


def run_window_mask(meta: SdpaMetadata, window: int, length: int) -> torch.Tensor:
    """[1, 1, length, length]: a KV-free run's mask (every sequence of it alike), causal included."""
    device = meta.common.cu_seqlens_q.device
    return step_memo(
        meta.memo,
        ("run-window", window, length),
        lambda: visible_keys(length, length, meta.is_causal, window, device)[None, None],
    )


def suffix_mask(meta: SdpaMetadata, index: int, window: int | None) -> torch.Tensor:
    """[1 or num_seqs, 1, len_q, len_k]: the mask of suffix-query run `index` (the prefill skip), causal
    (when the step is) and window included. Each sequence's queries are the last len_q of its keys; a run
    whose key lengths differ has its keys padded to the longest, and its padding hidden here too."""
    run = meta.runs[index]

    def make() -> torch.Tensor:
        device = meta.common.cu_seqlens_q.device
        if run.key_mask is None:
            lens = torch.full((1, 1, 1, 1), run.len_k, device=device)
        else:
            lens = run.key_mask.sum(dim=-1, keepdim=True)  # [n, 1, 1, 1]
        q_pos = lens - run.len_q + torch.arange(run.len_q, device=device)[:, None]  # [n, 1, len_q, 1]
        k_pos = torch.arange(run.len_k, device=device)
        seen = k_pos < lens
        if meta.is_causal:
            seen = seen & (k_pos <= q_pos)
        if window is not None:
            seen = seen & in_window(q_pos, k_pos, window)
        return seen

    return step_memo(meta.memo, ("suffix", index, window), make)


def decode_window_mask(meta: SdpaMetadata, window: int) -> torch.Tensor:
    """[num_decodes, 1, 1, blocks * block_size]: each decode's real keys within the window of its query
    (the last key)."""
    plan = meta.paged

    def make() -> torch.Tensor:
        keys = torch.arange(plan.decode_mask.shape[-1], device=plan.decode_mask.device)
        return plan.decode_mask & (keys > plan.decode_positions[:, None, None, None] - window)

    return step_memo(meta.memo, ("decode-window", window), make)


def chunk_window_mask(meta: SdpaMetadata, index: int, window: int) -> torch.Tensor:
    """[1, 1, len_q, len_k]: paged chunk `index`'s causal mask within the window, its queries the last
    len_q positions (a whole prompt: its own keys)."""
    chunk = meta.paged.chunks[index]
    device = chunk.table.device
    return step_memo(
        meta.memo,
        ("chunk-window", index, window),
        lambda: visible_keys(chunk.len_q, chunk.len_k, True, window, device)[None, None],
    )


# Banded runs: each block of queries attends over the keys its window can reach, with blocks of about the
# window's reach (2 * (window - 1)) rounded up to this: on CPU (benchmarks/local_window.py, ModernBERT's window
# of 65) blocks of 128 ran 1.2-1.6x faster than of 80 or 256.
_BAND_BLOCK_STEP = 16


def band_block(window: int) -> int:
    """Queries per block of a banded run; each block reads block + 2 * (window - 1) keys, about two blocks."""
    reach = max(2 * (window - 1), 1)
    return -(-reach // _BAND_BLOCK_STEP) * _BAND_BLOCK_STEP


def is_banded(window: int, length: int) -> bool:
    """Whether a run of `length` tokens runs banded rather than as the masked full square: when a block's
    keys are at most a quarter of the run. Banding copies the keys and values into blocks (padded at the
    ends), which at half the run cost more than the square saved (ModernBERT at 512 tokens: 108 ms banded,
    64 ms square; at 2048: 65 ms against 340 ms)."""
    return band_block(window) + 2 * (window - 1) <= length // 4


def _band_mask(meta: SdpaMetadata, window: int, length: int, num_seqs: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_seqs * blocks, 1, block, span] float, 0 where a query sees a key and -inf elsewhere (SDPA on CPU
    takes an additive mask 1.3x faster than a bool one here). Block b's query i is position b * block + i,
    its key j position b * block + j - (window - 1); a key is seen when real and in the window (and not after
    the query when causal). Padding queries past the run see every key (their rows are dropped; no row is
    all -inf)."""

    def make() -> torch.Tensor:
        device = meta.common.cu_seqlens_q.device
        block = band_block(window)
        blocks = -(-length // block)
        starts = torch.arange(blocks, device=device)[:, None, None] * block
        q_pos = starts + torch.arange(block, device=device)[:, None]  # [blocks, block, 1]
        k_pos = starts + torch.arange(block + 2 * (window - 1), device=device) - (window - 1)  # [blocks, 1, span]
        seen = (k_pos >= 0) & (k_pos < length) & in_window(q_pos, k_pos, window)
        if meta.is_causal:
            seen = seen & (k_pos <= q_pos)
        seen = (seen | (q_pos >= length))[:, None].repeat(num_seqs, 1, 1, 1)
        return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))

    return step_memo(meta.memo, ("band", window, length, num_seqs, dtype), make)


def _blocks_of_keys(x: torch.Tensor, num_seqs: int, length: int, window: int) -> torch.Tensor:
    """[num_seqs * length, heads, d] keys or values -> [num_seqs * blocks, heads, span, d]: each query block's
    reach, from window - 1 before its first query to window - 1 after its last (zeros past the run)."""
    block = band_block(window)
    blocks = -(-length // block)
    padding = (0, 0, 0, 0, window - 1, window - 1 + blocks * block - length)
    spans = F.pad(x.view(num_seqs, length, *x.shape[1:]), padding).unfold(1, block + 2 * (window - 1), block)
    return spans.permute(0, 1, 2, 4, 3).reshape(num_seqs * blocks, x.shape[1], -1, x.shape[2])


def attend_banded(
    attend, q, k, v, num_seqs: int, length: int, window: int, meta: SdpaMetadata, mask_dtype: torch.dtype
) -> torch.Tensor:
    """A KV-free run of `num_seqs` sequences of `length` tokens under a window, at the window's cost: the
    queries in blocks, each over only the keys its window reaches, in one batched call. `attend(qb, kb, vb,
    mask)` is the backend's batched attention taking a float mask of `mask_dtype`; rows in ->
    [num_seqs * length, heads, d] out."""
    block = band_block(window)
    blocks = -(-length // block)
    heads, size = q.shape[1:]
    qn = q.view(num_seqs, length, heads, size)
    if blocks * block > length:
        qn = F.pad(qn, (0, 0, 0, 0, 0, blocks * block - length))
    qb = qn.view(num_seqs * blocks, block, heads, size).transpose(1, 2)
    kb = _blocks_of_keys(k, num_seqs, length, window)
    vb = _blocks_of_keys(v, num_seqs, length, window)
    out = attend(qb, kb, vb, _band_mask(meta, window, length, num_seqs, mask_dtype))  # [n * blocks, heads, block, d]
    return out.transpose(1, 2).reshape(num_seqs, blocks * block, heads, size)[:, :length].reshape(-1, heads, size)
