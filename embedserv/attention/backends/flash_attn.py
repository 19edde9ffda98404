"""flash-attn's varlen kernel (the optional `flash` extra), on CUDA.

Same packed layout as ours: `[num_tokens, heads, head_size]` plus int32 `cu_seqlens`; grouped-query
attention is native (fewer KV heads than query heads).
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func

from embedserv.attention.backends.base import write_and_gather
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class FlashAttnBackend:
    name = "flash_attn"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        common = meta.common
        if kv_cache is not None:
            # Queries are the last keys of their sequence: the kernel's causal mask aligns them at the end.
            k, v = write_and_gather(k, v, kv_cache, common)
        return flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=common.cu_seqlens_q,
            cu_seqlens_k=common.cu_seqlens_k,
            max_seqlen_q=common.max_seqlen_q,
            max_seqlen_k=common.max_seqlen_k,
            softmax_scale=layer.scale,
            causal=common.is_causal,
        )
