"""torch.nn.attention.varlen: the flash-attention 2 varlen kernel that ships with torch (CUDA).

It takes the packed batch as it is, `[num_tokens, heads, head_size]` plus `cu_seqlens`, in one launch.
The function's keywords changed between torch releases: 2.10 has `is_causal`, later ones `window_size`,
`scale` and `enable_gqa`, and later still `seqused_k` and `block_table`. The adapter below reads the
signature once and fills in what is missing.

With a paged KV cache, a torch whose kernel takes `block_table` reads the cache in place: keys and values
are the cache's `[num_blocks, block_size, kv_heads, d]` halves, `block_table` maps each sequence's logical
pages to physical ones and `seqused_k` bounds each read (`cu_seq_k` is still required by the aten op,
which takes both offsets or neither; with `seqused_k` it only sizes the launch). That kernel is
flash-attention 2's: it reads pages of a multiple of 256 tokens (`mha_varlen_fwd` refuses others).
An older torch gets the step's keys gathered into a packed batch first, from any block size.

Cross-attention needs nothing of its own: keys are packed by `cu_seqlens_k` (KV-free) or read through the
cross block tables up to `seqused_k` (paged), and the metadata says not causal. Nor do suffix queries
(the prefill skip): keys packed by `cu_seqlens_k`, the causal mask and window aligned at the end. A
sliding window is `window_size` (windows.flash_window); a torch without it runs no window, and the
selector never picks it for a model with one. T5's relative position bias it cannot add (no per-head
score bias): the selector never picks it for such a model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention.varlen import varlen_attn

from embedserv.attention.backends.base import (
    AttentionLayer,
    PagedBackendBase,
    gather_kv,
    packed_key_slots,
    refuse_score_bias,
    write_kv,
)
from embedserv.attention.backends.windows import flash_window
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
# Whether this torch's kernel takes a sliding window (selector.py asks the same of the signature).
TAKES_WINDOW = "window_size" in _PARAMS
# Whether this torch's kernel reads a paged cache through block tables (torch 2.13 does).
PAGED_KERNEL = {"block_table", "seqused_k"} <= _PARAMS
# flash-attention 2's paged KV: pages of a multiple of 256 tokens.
_PAGE_MULTIPLE = 256


@dataclass(frozen=True)
class VarlenMetadata(AttentionMetadata):
    # Fallback for a torch without `block_table`: [sum(seq_lens_k)] cache slots of the packed keys.
    gather_slots: torch.Tensor | None = None


def _expand_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    # dim -2 is the KV-head dimension of packed keys and of cache pages alike.
    return kv.repeat_interleave(group, dim=-2) if group > 1 else kv


class VarlenBackend(PagedBackendBase):
    name = "varlen"
    default_block_size = _PAGE_MULTIPLE if PAGED_KERNEL else PagedBackendBase.default_block_size
    block_size_multiple = _PAGE_MULTIPLE if PAGED_KERNEL else 1

    def build_metadata(self, common: CommonAttentionMetadata) -> VarlenMetadata:
        if common.reads_kv_cache and not PAGED_KERNEL:
            return VarlenMetadata(common=common, gather_slots=packed_key_slots(common))
        return VarlenMetadata(common=common)

    def forward(self, layer: AttentionLayer, q, k, v, kv_cache, meta: VarlenMetadata, positions=None) -> torch.Tensor:
        refuse_score_bias(layer, self.name)
        common = meta.common
        kwargs = {}
        if kv_cache is not None:
            write_kv(k, v, kv_cache, common)
            if PAGED_KERNEL:
                k, v = kv_cache[0], kv_cache[1]
                kwargs.update(block_table=common.block_tables, seqused_k=common.seq_lens_k)
            else:
                # Queries are the last keys of their sequence: the kernel's causal mask aligns them at the end.
                k, v = gather_kv(kv_cache, meta.gather_slots)
        if TAKES_WINDOW:
            kwargs["window_size"] = flash_window(layer.sliding_window, common.is_causal)
        elif layer.sliding_window is not None:
            raise NotImplementedError(
                f"attention layer {layer.layer_index}: torch {torch.__version__}'s varlen_attn takes no "
                "window_size and cannot run a sliding window; use sdpa or flex"
            )
        else:
            kwargs["is_causal"] = common.is_causal
        if "scale" in _PARAMS:
            kwargs["scale"] = layer.scale
        else:
            # The kernel scales by head_size ** -0.5; fold the layer's own scale into q.
            q = q * (layer.scale * q.shape[-1] ** 0.5)
        group = q.shape[1] // k.shape[-2]
        if "enable_gqa" in _PARAMS:
            kwargs["enable_gqa"] = group > 1
        else:
            k, v = _expand_kv(k, group), _expand_kv(v, group)
        return varlen_attn(
            q, k, v, common.cu_seqlens_q, common.cu_seqlens_k, common.max_seqlen_q, common.max_seqlen_k, **kwargs
        )
