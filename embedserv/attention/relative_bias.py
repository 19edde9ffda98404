"""T5's relative position bias: a learned per-head score added to attention, by bucketed distance.

T5 has no position embeddings. Instead the first self-attention layer of each stack (encoder, decoder)
learns `[num_buckets, num_heads]` biases, indexed by the bucket of `key_position - query_position`
(half the buckets per direction when bidirectional, exact buckets for short distances and logarithmic
ones up to `max_distance`), and every layer of the stack adds the same bias to its scores. MPNet's encoder
holds one such table (bidirectional, 32 buckets, max distance 128) beside its position embeddings.

Past `max_distance` the bucket no longer changes (the largest of its side), so the bias of any distance is
`distance_table()[h, clamp(d, -M, M) + M]` with M = max_distance: one small table per forward pass that
every backend indexes, however long the sequences.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(
    distance: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """transformers' T5Attention._relative_position_bucket, for `distance` = key - query positions."""
    buckets = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (distance > 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = -torch.clamp(distance, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = (
        max_exact
        + (
            torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
    )
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """The learned table of one T5 stack; every self-attention layer of the stack holds a reference."""

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        # Checkpoint name: relative_attention_bias.weight, [num_buckets, num_heads].
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def distance_table(self) -> torch.Tensor:
        """[num_heads, 2 * max_distance + 1] float32: the bias of distance d (key - query) at d + max_distance."""
        distance = torch.arange(
            -self.max_distance, self.max_distance + 1, device=self.relative_attention_bias.weight.device
        )
        buckets = relative_position_bucket(distance, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).float().t().contiguous()

    def bias(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, table: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[num_heads, len(query_positions), len(key_positions)] float32, from the table (computed if None)."""
        table = self.distance_table() if table is None else table
        distance = (key_positions[None, :] - query_positions[:, None]).clamp(-self.max_distance, self.max_distance)
        return table[:, distance + self.max_distance]
