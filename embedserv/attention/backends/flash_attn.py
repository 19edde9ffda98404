"""flash-attn's varlen kernel (the optional `flash` extra, flash-attn >= 2.6), on CUDA.

Same packed layout as ours: `[num_tokens, heads, head_size]` plus int32 `cu_seqlens`; grouped-query
attention is native (fewer KV heads than query heads).

With a paged KV cache the kernel reads the cache in place: k and v are the cache's
`[num_blocks, block_size, kv_heads, d]` halves and `block_table` maps each sequence's logical pages to
physical ones. `cu_seqlens_k` stays the cumulative key lengths: with a block table the kernel takes each
sequence's key count from it and the page addresses from the table. Its causal mask is aligned at the
end (a query sees the keys up to its own position among the last ones), which is our layout. flash-attn 2
reads pages of a multiple of 256 tokens only (`mha_varlen_fwd` refuses others), hence the block size.

Cross-attention is the same call: `cu_seqlens_k` packs (KV-free) or counts (paged, cross block tables) the
encoder keys, and `causal` is the metadata's (False); so are suffix queries (the prefill skip), whose
causal mask and window the kernel aligns at the end. A sliding window is `window_size=(left, right)`
(windows.flash_window). T5's relative position bias it cannot add (no per-head score bias): the selector
never picks it for such a model.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func

from embedserv.attention.backends.base import AttentionLayer, PagedBackendBase, refuse_score_bias, write_kv
from embedserv.attention.backends.windows import flash_window
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class FlashAttnBackend(PagedBackendBase):
    name = "flash_attn"
    default_block_size = 256
    block_size_multiple = 256

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(
        self, layer: AttentionLayer, q, k, v, kv_cache, meta: AttentionMetadata, positions=None
    ) -> torch.Tensor:
        refuse_score_bias(layer, self.name)
        common = meta.common
        paged = {}
        if kv_cache is not None:
            write_kv(k, v, kv_cache, common)
            k, v = kv_cache[0], kv_cache[1]
            paged["block_table"] = common.block_tables
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=common.cu_seqlens_q,
            cu_seqlens_k=common.cu_seqlens_k,
            max_seqlen_q=common.max_seqlen_q,
            max_seqlen_k=common.max_seqlen_k,
            softmax_scale=layer.scale,
            causal=common.is_causal,
            window_size=flash_window(layer.sliding_window, common.is_causal),
            **paged,
        )
