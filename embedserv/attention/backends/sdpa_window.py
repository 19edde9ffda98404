"""Sliding-window and suffix-query masks for the sdpa backend: bool, True where a query sees a key.

Each is made by the step's first layer that needs it and kept in the step's metadata (base.step_memo),
keyed by the window, for the step's other layers: a model's windowed and full layers share a step. A layer
without a window (or whose window no sequence outgrows) takes none of them.
"""

from __future__ import annotations

import torch

from embedserv.attention.backends.base import step_memo
from embedserv.attention.backends.sdpa_runs import SdpaMetadata
from embedserv.attention.backends.windows import in_window, visible_keys


def run_window_mask(meta: SdpaMetadata, window: int, length: int) -> torch.Tensor:
    """[1, 1, length, length]: a KV-free run's mask (every sequence of it alike), causal included."""
    device = meta.common.cu_seqlens_q.device
    return step_memo(
        meta.memo, ("run-window", window, length),
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
        meta.memo, ("chunk-window", index, window),
        lambda: visible_keys(chunk.len_q, chunk.len_k, True, window, device)[None, None],
    )
