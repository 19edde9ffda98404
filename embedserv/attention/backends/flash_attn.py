"""flash-attn's varlen kernel (the optional `flash` extra), on CUDA.

Same packed layout as ours: `[num_tokens, heads, head_size]` plus int32 `cu_seqlens`; grouped-query
attention is native (fewer KV heads than query heads).
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func

from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class FlashAttnBackend:
    name = "flash_attn"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache is not None:
            raise NotImplementedError("the flash_attn backend has no KV cache support yet")
        common = meta.common
        return flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=common.cu_seqlens_q,
            cu_seqlens_k=common.cu_seqlens_k,
            max_seqlen_q=common.max_seqlen_q,
            max_seqlen_k=common.max_seqlen_k,
            softmax_scale=layer.scale,
            causal=common.is_causal,
        )
