"""The narrow interface every attention backend implements, and the paged-KV helpers they share.

Where each backend can run (device, dtype, head size) is decided in attention/selector.py, not here; a
backend only says which cache block sizes its paged kernel can read (`check_block_size`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import numpy as np
import torch

from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

if TYPE_CHECKING:
    from embedserv.attention.disentangled import DisentangledPositions, PositionProjections
    from embedserv.attention.relative_bias import RelativePositionBias

_T = TypeVar("_T")


class AttentionLayer(Protocol):
    """What a backend reads of the layer it runs (attention/layer.py's Attention is one); the rest of a
    layer (kind, group, cache) is the runner's routing, already resolved into the metadata and cache."""

    # Names the layer in errors.
    layer_index: int
    # Multiplies q . k.
    scale: float
    # W: a query at position p sees the key at j only when |p - j| < W (attention/backends/windows.py);
    # None: every key.
    sliding_window: int | None
    # T5's and MPNet's per-head score bias by distance (one table per stack); None for other models.
    relative_bias: RelativePositionBias | None
    # DeBERTa's disentangled position bias (its positions come with each call); None for other models.
    disentangled: DisentangledPositions | None


class AttentionBackend(Protocol):
    name: ClassVar[str]
    # Tokens per KV-cache block when the user does not choose.
    default_block_size: ClassVar[int]

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Precomputes per-batch state once, before the forward pass."""

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        positions: PositionProjections | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].

        With a cache, k and v are this step's new keys and values, written to their slots first; both are
        None for a layer that shares another layer's cache: it writes nothing and reads every key from the
        cache. `positions`: a disentangled layer's position projections, [2 * span, num_heads, head_size]
        each (attention/disentangled.py). Returns [num_tokens, num_heads, head_size] in q's dtype.
        """

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The shape of one layer's cache tensor."""

    def check_block_size(self, block_size: int, device: torch.device) -> None:
        """Raises ValueError when this backend cannot read a cache of `block_size` tokens per block on `device`."""


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's paged cache: keys at [0], values at [1]; every backend reads this layout."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


class PagedBackendBase:
    """What every backend says about its cache: the one layout, a default block size, the sizes it reads."""

    name: ClassVar[str]
    default_block_size: ClassVar[int] = 16
    # The paged kernel reads blocks of a multiple of this many tokens (1: any size).
    block_size_multiple: ClassVar[int] = 1

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    def check_block_size(self, block_size: int, device: torch.device) -> None:
        multiple = self.block_size_multiple_on(torch.device(device))
        if block_size < 1 or block_size % multiple:
            raise ValueError(
                f"the {self.name} attention backend reads KV-cache blocks of a multiple of "
                f"{multiple} tokens on {torch.device(device).type}, not {block_size}"
            )

    def block_size_multiple_on(self, device: torch.device) -> int:
        return self.block_size_multiple


def write_kv(
    k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor, common: CommonAttentionMetadata
) -> None:
    """Writes the step's new keys and values into their cache slots; a shared layer (k, v None) writes none."""
    if k is None or v is None:
        return
    kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, common.slot_mapping, k)
    kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, common.slot_mapping, v)


def gather_blocks(kv_cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks, in table order: tables [*S, nb] -> keys, values [*S, nb * block_size, kv_heads, d].

    Block-granular: one index per block, never per token. Slots past a sequence's length come along and
    must be masked (or sliced off) by the caller."""
    _, _, block_size, kv_heads, size = kv_cache.shape
    flat = tables.reshape(-1)
    shape = (*tables.shape[:-1], tables.shape[-1] * block_size, kv_heads, size)
    return kv_cache[0].index_select(0, flat).view(shape), kv_cache[1].index_select(0, flat).view(shape)


def packed_key_slots(common: CommonAttentionMetadata) -> torch.Tensor:
    """[sum(seq_lens_k)] int64: the cache slot of every key, packed like `cu_seqlens_k`.

    Only for the fallback of kernels that cannot read through block tables (they take packed keys); built
    once per step from the device block tables, with the host-known lengths."""
    lens_k = common.seq_lens_k_cpu
    starts = np.concatenate(([0], np.cumsum(lens_k)[:-1]))
    seqs = np.repeat(np.arange(len(lens_k)), lens_k)
    positions = np.arange(int(lens_k.sum())) - np.repeat(starts, lens_k)
    device = common.block_tables.device
    seqs_t = torch.from_numpy(seqs).to(device)
    positions_t = torch.from_numpy(positions).to(device)
    size = common.block_size
    return common.block_tables[seqs_t, positions_t // size].long() * size + positions_t % size


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at cache `slots` (any shape S): [*S, num_kv_heads, head_size] each."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    flat = slots.reshape(-1)
    keys = kv_cache[0].view(-1, num_kv_heads, head_size).index_select(0, flat)
    values = kv_cache[1].view(-1, num_kv_heads, head_size).index_select(0, flat)
    return keys.view(*slots.shape, num_kv_heads, head_size), values.view(*slots.shape, num_kv_heads, head_size)


def step_memo(memo: dict, key: Hashable, make: Callable[[], _T]) -> _T:
    """`memo[key]`, made on first use: what every layer of a step would otherwise recompute (T5's bias
    table and the masks built from it) is made by the step's first layer that needs it and kept in the
    step's metadata. Keys hold what they depend on (the bias module itself, not its id)."""
    value = memo.get(key)
    if value is None:
        value = memo[key] = make()
    return value


def relative_bias_table(layer: AttentionLayer, memo: dict) -> torch.Tensor | None:
    """[num_heads, 2 * max_distance + 1] float32: the layer's T5 distance table, once per step and stack
    (every layer of a stack holds the same RelativePositionBias); None for a layer without one.

    Detached: no backend here backpropagates, and FlexAttention would have to through a captured table."""
    bias = getattr(layer, "relative_bias", None)
    if bias is None:
        return None
    return step_memo(memo, ("bias-table", bias), lambda: bias.distance_table().detach())


def refuse_relative_bias(layer: AttentionLayer, backend: str) -> None:
    """For kernels that cannot add a per-head score bias: the selector never picks them for such a model
    (attention/selector.py); reaching one anyway is a bug, not a wrong answer."""
    if getattr(layer, "relative_bias", None) is not None:
        raise NotImplementedError(
            f"attention layer {layer.layer_index}: the {backend} attention backend cannot add the relative "
            "position bias of T5 and MPNet; use sdpa, flex or naive"
        )


def refuse_score_bias(layer: AttentionLayer, backend: str) -> None:
    """refuse_relative_bias, and the same for DeBERTa's disentangled bias."""
    refuse_relative_bias(layer, backend)
    if getattr(layer, "disentangled", None) is not None:
        raise NotImplementedError(
            f"attention layer {layer.layer_index}: the {backend} attention backend cannot add DeBERTa's "
            "disentangled position bias; use sdpa, flex or naive"
        )
