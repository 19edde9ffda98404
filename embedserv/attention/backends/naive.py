"""The oracle: one sequence at a time, explicit softmax in float32. Slow, obviously right."""

from __future__ import annotations

import math

import torch

from embedserv.attention.backends.base import write_and_gather
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class NaiveBackend:
    name = "naive"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        common = meta.common
        if kv_cache is not None:
            k, v = write_and_gather(k, v, kv_cache, common)
        scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        q_start = k_start = 0
        for len_q, len_k in zip(common.seq_lens_q_cpu.tolist(), common.seq_lens_k_cpu.tolist()):
            rows = slice(q_start, q_start + len_q)
            keys = slice(k_start, k_start + len_k)
            qs = q[rows].float().transpose(0, 1)  # [H, Lq, D]
            ks = k[keys].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
            vs = v[keys].float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * scale  # [H, Lq, Lk]
            if meta.is_causal:
                scores = scores.masked_fill(future_mask(len_q, len_k, q.device), float("-inf"))
            out[rows] = (scores.softmax(dim=-1) @ vs).transpose(0, 1).to(q.dtype)
            q_start += len_q
            k_start += len_k
        return out


def future_mask(len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """[len_q, len_k] bool, True where a key lies after the query: queries are the last len_q keys."""
    return torch.ones(len_q, len_k, dtype=torch.bool, device=device).triu(len_k - len_q + 1)
