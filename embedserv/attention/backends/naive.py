"""The oracle: one sequence at a time, explicit softmax in float32. Slow, obviously right."""

from __future__ import annotations

import math

import torch

from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class NaiveBackend:
    name = "naive"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache is not None:
            raise NotImplementedError("the naive backend has no KV cache support yet")
        scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        start = 0
        for length in meta.common.seq_lens_q_cpu.tolist():
            end = start + length
            qs = q[start:end].float().transpose(0, 1)  # [H, L, D]
            ks = k[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * scale  # [H, L, L]
            if meta.is_causal:
                future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            out[start:end] = (scores.softmax(dim=-1) @ vs).transpose(0, 1).to(q.dtype)
            start = end
        return out
