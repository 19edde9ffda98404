"""The one attention layer every model uses; the only reader of the forward context."""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.forward_context import get_forward_context


class AttentionKind(str, Enum):
    # Bidirectional over the (encoder) input, never a KV cache.
    ENCODER = "encoder"
    # Self-attention of a decoder (or of an encoder-only model): causal or not as the metadata says;
    # paged KV when generating.
    DECODER = "decoder"
    # Decoder queries over keys and values computed once from the encoder output (a fixed KV group).
    CROSS = "cross"


class Attention(nn.Module):
    """Attention over the packed batch described by the forward context.

    q: [num_tokens, num_heads * head_size]; k, v: [num_tokens, num_kv_heads * head_size], or both None for
    a layer with a `kv_source_layer`: it has no K/V projections, reads that layer's cache, writes nothing
    and owns no cache. Whether attention is causal comes from the metadata, so one model class serves both.

    A CROSS layer's q holds the decoder tokens and its k, v the encoder tokens of the sequences whose
    encoder runs in this step (a request's first step), or both None when no encoder runs: its keys are
    then all in the cross KV cache (or, without a cache, there is nothing to attend to). `relative_bias`
    (T5) is added to the scores by distance; only self-attention layers carry one.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        layer_index: int = 0,
        kind: AttentionKind = AttentionKind.DECODER,
        kv_group: int = 0,
        kv_source_layer: int | None = None,
        relative_bias: RelativePositionBias | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {self.num_kv_heads} KV head groups")
        self.scale = scale if scale is not None else head_size**-0.5
        self.layer_index = layer_index
        self.kind = AttentionKind(kind)
        self.kv_group = kv_group
        self.kv_source_layer = kv_source_layer
        if relative_bias is not None and self.kind is AttentionKind.CROSS:
            raise ValueError("cross-attention takes no relative position bias")
        # Not a submodule: the stack owns it (one table for all its layers).
        self.__dict__["relative_bias"] = relative_bias

    @property
    def owns_kv_cache(self) -> bool:
        return self.kind is not AttentionKind.ENCODER and self.kv_source_layer is None

    @property
    def cache_layer(self) -> int:
        """The layer whose cache this one reads (its own unless it shares another's)."""
        return self.layer_index if self.kv_source_layer is None else self.kv_source_layer

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        context = get_forward_context()
        out = context.attn_backend.forward(
            self,
            q.view(-1, self.num_heads, self.head_size),
            None if k is None else k.view(-1, self.num_kv_heads, self.head_size),
            None if v is None else v.view(-1, self.num_kv_heads, self.head_size),
            context.kv_cache_for(self),
            context.metadata_for(self),
        )
        return out.reshape(-1, self.num_heads * self.head_size)
