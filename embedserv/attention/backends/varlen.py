"""torch.nn.attention.varlen: the flash-attention 2 varlen kernel that ships with torch (CUDA).

It takes the packed batch as it is, `[num_tokens, heads, head_size]` plus `cu_seqlens`, in one launch.
The function's keywords changed between torch releases: 2.10 has `is_causal`, later ones `window_size`,
`scale` and `enable_gqa`. The adapter below reads the signature once and fills in what is missing.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention.varlen import varlen_attn

from embedserv.attention.backends.base import write_and_gather
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)


def _expand_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv.repeat_interleave(group, dim=1) if group > 1 else kv


class VarlenBackend:
    name = "varlen"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        common = meta.common
        if kv_cache is not None:
            # Queries are the last keys of their sequence: the kernel's causal mask aligns them at the end.
            k, v = write_and_gather(k, v, kv_cache, common)
        kwargs = {}
        if "window_size" in _PARAMS:
            kwargs["window_size"] = (-1, 0) if common.is_causal else (-1, -1)
        else:
            kwargs["is_causal"] = common.is_causal
        if "scale" in _PARAMS:
            kwargs["scale"] = layer.scale
        else:
            # The kernel scales by head_size ** -0.5; fold the layer's own scale into q.
            q = q * (layer.scale * q.shape[-1] ** 0.5)
        group = q.shape[1] // k.shape[1]
        if "enable_gqa" in _PARAMS:
            kwargs["enable_gqa"] = group > 1
        else:
            k, v = _expand_kv(k, group), _expand_kv(v, group)
        return varlen_attn(
            q, k, v, common.cu_seqlens_q, common.cu_seqlens_k, common.max_seqlen_q, common.max_seqlen_k, **kwargs
        )
