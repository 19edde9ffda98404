"""cpu_varlen: KV-free attention on CPU in one C++ call over the packed batch (cpu_varlen.cpp).

The kernel takes the packed layout as the input builder makes it, `[num_tokens, heads, head_size]` plus
`cu_seqlens`, with its strides (q, k and v may be views of one fused projection): no run planning, no
padding, one parallel loop over (sequence, head, block of queries) whatever the mix of lengths. Queries are
the last len_q of their sequence's len_k positions, so KV-free self-attention, cross-attention and the
prefill skip's suffix queries all go through it, causal or not, with or without a sliding window, GQA
included; float32 and bfloat16 (float32 accumulation).

Steps over the paged KV cache (generation) run the sdpa backend's paths for prompts, and the same library's
`paged_decode` for one-token decodes: each query reads its keys and values in place through its block table,
nothing gathered (sdpa's decode copies every key of the step first). Everything runs sdpa when the kernel
could not be built here (no compiler: cpu_varlen_kernel.py logs why once). Score biases (T5, MPNet, DeBERTa)
it cannot add: the selector never picks it for such a model.
"""

from __future__ import annotations

import torch

from embedserv.attention.backends.base import AttentionLayer, refuse_score_bias
from embedserv.attention.backends.cpu_varlen_kernel import attention_op, paged_decode_op
from embedserv.attention.backends.sdpa import SdpaBackend, forward_paged
from embedserv.attention.backends.sdpa_runs import SdpaMetadata
from embedserv.attention.metadata import CommonAttentionMetadata


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class CpuVarlenBackend(SdpaBackend):
    name = "cpu_varlen"

    def __init__(self) -> None:
        # Built (or loaded from the cache) on the first backend made in a process, before the first step.
        self._op = attention_op()
        self._decode_op = paged_decode_op()

    @property
    def uses_kernel(self) -> bool:
        """False where the kernel could not be built here: every step runs sdpa's paths."""
        return self._op is not None

    def build_metadata(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        if common.reads_kv_cache or self._op is None:
            return super().build_metadata(common)
        # The kernel plans nothing on the host.
        return SdpaMetadata(common=common, runs=(), suffix=common.suffix_queries)

    def forward(self, layer: AttentionLayer, q, k, v, kv_cache, meta: SdpaMetadata, positions=None) -> torch.Tensor:
        if kv_cache is not None and self._op is not None and positions is None:
            # Prompts over the cache run sdpa's paths; one-token decodes the kernel's paged_decode.
            return forward_paged(layer, q, k, v, kv_cache, meta, self._decode_op)
        if kv_cache is not None or self._op is None:
            return super().forward(layer, q, k, v, kv_cache, meta, positions)
        refuse_score_bias(layer, self.name)
        common = meta.common
        return self._op(
            _last_dim_contiguous(q),
            _last_dim_contiguous(k),
            _last_dim_contiguous(v),
            common.cu_seqlens_q,
            common.cu_seqlens_k,
            common.is_causal,
            layer.sliding_window or 0,
            layer.scale,
        )
