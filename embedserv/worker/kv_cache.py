"""The paged KV cache of a generating model: its groups, their block count, one tensor per owning layer.

A model's attention layers say what they need (attention/layer.py): encoder layers keep no KV; decoder
and cross layers name a KV-cache group; a layer with a `kv_source_layer` reads that layer's cache and
owns none. One group is one block size and dtype for all its layers, and one block table per request
(scheduler/kv_cache_manager.py); cross groups are fixed-size tables. Layers of one group may differ in KV
heads and head size (Gemma 4's full and sliding layers): a block id is a slot range in each of their
tensors whatever its shape, so one table (and one prefix cache) serves them all.

Every group gets the same number of blocks, so a block id means a slot range in every cache tensor of its
group: `num_blocks` = `--kv-cache-memory` / (bytes of one block in every owning layer of every group).
A layer that shares another's cache adds nothing to that sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.layer import Attention, AttentionKind, attention_layers
from embedserv.errors import ConfigError
from embedserv.scheduler.kv_cache_manager import KvGroup


@dataclass(frozen=True)
class KvCacheGroupSpec:
    block_size: int
    dtype: torch.dtype
    # Layers that own a cache tensor in this group, by layer_index, and each one's (KV heads, head size).
    layers: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]
    # Cross-attention: a table sized from the encoder input at admission, never grown or prefix-cached.
    fixed: bool = False

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * sum(heads * size for heads, size in self.shapes) * element

    def scheduler_group(self) -> KvGroup:
        return KvGroup(block_size=self.block_size, fixed=self.fixed)


class KvCache:
    """A replica's paged KV cache: one tensor per layer (None where a layer owns none), and its groups.

    Backends read whole blocks and mask the slots past a sequence's length (and table padding, block 0);
    a masked slot holding a NaN bit pattern would still reach the output (0 x NaN in the softmax). So each
    block is zeroed the first time a step names it; after that its stale slots hold finite values.
    """

    def __init__(self, tensors: list[torch.Tensor | None], groups: list[KvCacheGroupSpec], num_blocks: int) -> None:
        self.tensors = tensors
        self.groups = groups
        # Blocks in every group.
        self.num_blocks = num_blocks
        self._used = [np.zeros(num_blocks, dtype=bool) for _ in groups]
        self.zero([[0] for _ in groups])  # the padding of every block table

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    def fresh_blocks(self, tables_per_group: Sequence[np.ndarray]) -> list[list[int]] | None:
        """Blocks of a step that were never used before, per group (marked used now); None if none.
        Called in step order (a worker prepares steps in the order it runs them)."""
        fresh = []
        for used, tables in zip(self._used, tables_per_group, strict=True):
            blocks = np.unique(tables)
            new = blocks[~used[blocks]]
            used[new] = True
            fresh.append(new.tolist())
        return fresh if any(fresh) else None

    def zero(self, fresh: list[list[int]]) -> None:
        """Zeroes these blocks (per group) in every layer of their group."""
        for group, blocks in zip(self.groups, fresh, strict=True):
            if not blocks:
                continue
            index = torch.tensor(blocks, device=self.tensors[group.layers[0]].device)
            for layer in group.layers:
                self.tensors[layer].index_fill_(1, index, 0)
        for used, blocks in zip(self._used, fresh, strict=True):
            used[blocks] = True


def kv_cache_groups(model: nn.Module, block_size: int, dtype: torch.dtype) -> list[KvCacheGroupSpec]:
    """The model's groups, in kv_group order; layers of one group must be of one kind."""
    by_group: dict[int, list[Attention]] = {}
    for layer in attention_layers(model):
        if layer.owns_kv_cache:
            by_group.setdefault(layer.kv_group, []).append(layer)
    if sorted(by_group) != list(range(len(by_group))):
        raise ValueError(f"KV-cache groups must be numbered 0..n-1, not {sorted(by_group)}")
    specs = []
    for group in range(len(by_group)):
        layers = by_group[group]
        kinds = {layer.kind for layer in layers}
        if len(kinds) != 1:
            raise ValueError(f"KV-cache group {group} mixes layer kinds: {sorted(kind.value for kind in kinds)}")
        specs.append(
            KvCacheGroupSpec(
                block_size,
                dtype,
                tuple(layer.layer_index for layer in layers),
                tuple((layer.num_kv_heads, layer.head_size) for layer in layers),
                fixed=kinds.pop() is AttentionKind.CROSS,
            )
        )
    return specs


def kv_cache_bytes(memory: float, device: torch.device) -> int:
    """`--kv-cache-memory` in bytes: values up to 1 are a fraction of the free device memory (CUDA)."""
    if memory > 1:
        return int(memory)
    if device.type != "cuda":
        raise ConfigError(
            f"--kv-cache-memory {memory} is a fraction, which needs CUDA; on {device.type} give bytes (e.g. 2GiB)"
        )
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * memory)


def num_kv_blocks(memory: float, groups: list[KvCacheGroupSpec], device: torch.device) -> int:
    budget = kv_cache_bytes(memory, device)
    per_block = sum(group.bytes_per_block for group in groups)
    blocks = budget // per_block if per_block else 0
    if blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory {budget} bytes holds no block of {groups[0].block_size} tokens "
            f"({per_block} bytes each for this model); give more"
        )
    return int(blocks)


def allocate_kv_caches(
    model: nn.Module,
    groups: list[KvCacheGroupSpec],
    num_blocks: int,
    backend: AttentionBackend,
    device: torch.device,
) -> list[torch.Tensor | None]:
    """One cache tensor per owning layer, by layer_index; None for layers that own none."""
    layers = attention_layers(model)
    caches: list[torch.Tensor | None] = [None] * (max((m.layer_index for m in layers), default=-1) + 1)
    for group in groups:
        for index, (kv_heads, head_size) in zip(group.layers, group.shapes, strict=True):
            shape = backend.kv_cache_shape(num_blocks, group.block_size, kv_heads, head_size)
            # Uninitialized, so that memory is committed only as blocks are used; each block is zeroed on
            # its first use (KvCache.fresh_blocks, KvCache.zero).
            caches[index] = torch.empty(shape, dtype=group.dtype, device=device)
    return caches
