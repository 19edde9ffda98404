"""The one attention layer every model uses; the only reader of the forward context."""

from __future__ import annotations

import torch
from torch import nn

from embedserv.forward_context import get_forward_context


class Attention(nn.Module):
    """Attention over the packed batch described by the forward context.

    q: [num_tokens, num_heads * head_size]; k, v: [num_tokens, num_kv_heads * head_size].
    Whether attention is causal comes from the metadata, so one model class serves both kinds.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {self.num_kv_heads} KV head groups")
        self.scale = scale if scale is not None else head_size**-0.5
        self.layer_index = layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        kv_cache = context.kv_caches[self.layer_index] if context.kv_caches else None
        out = context.attn_backend.forward(
            self,
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size),
            kv_cache,
            context.attn_metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_size)
