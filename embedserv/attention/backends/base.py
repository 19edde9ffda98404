"""The narrow interface every attention backend implements.

Where each backend can run (device, dtype, head size) is decided in attention/selector.py, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

if TYPE_CHECKING:
    from embedserv.attention.layer import Attention


class AttentionBackend(Protocol):
    name: ClassVar[str]

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Precomputes per-batch state once, before the forward pass."""

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].

        Returns [num_tokens, num_heads, head_size] in q's dtype.
        """
