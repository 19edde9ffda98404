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


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's paged cache: keys at [0], values at [1]; every backend reads this layout."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata) -> None:
    """Writes the step's new keys and values into their cache slots."""
    kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, common.slot_mapping, k)
    kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, common.slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at cache `slots` (any shape S): [*S, num_kv_heads, head_size] each."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat = slots.reshape(-1)
    keys = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, flat)
    values = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, flat)
    return keys.view(*slots.shape, num_kv_heads, head_size), values.view(*slots.shape, num_kv_heads, head_size)


def write_and_gather(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new keys and values, then reads every key and value the step attends to through the
    block tables: [sum(seq_lens_k), num_kv_heads, head_size] each, packed by `cu_seqlens_k`. After this a
    backend computes packed attention whose queries are the last keys of each sequence."""
    write_kv(k, v, kv_cache, common)
    return gather_kv(kv_cache, common.key_slots)
