"""The paged KV cache of a generating model: one tensor per attention layer, allocated once at start-up.

Each layer holds `num_blocks` blocks of `block_size` tokens for keys and for values (layout in
attention/backends/base.py: kv_cache_shape). The BlockManager hands out block ids; a token's slot is
`block_id * block_size + offset`. How many blocks there are follows from `--kv-cache-memory`: a byte
count, or on CUDA a fraction of the memory free once the weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedserv.attention.backends.base import kv_cache_shape
from embedserv.errors import ConfigError


@dataclass(frozen=True)
class KvCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element


def kv_cache_bytes(memory: float, device: torch.device) -> int:
    """`--kv-cache-memory` in bytes: values up to 1 are a fraction of the free device memory (CUDA)."""
    if memory > 1:
        return int(memory)
    if device.type != "cuda":
        raise ConfigError(f"--kv-cache-memory {memory} is a fraction, which needs CUDA; on {device.type} give bytes (e.g. 2GiB)")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * memory)


def num_kv_blocks(memory: float, spec: KvCacheSpec, device: torch.device) -> int:
    budget = kv_cache_bytes(memory, device)
    blocks = budget // spec.bytes_per_block
    if blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory {budget} bytes holds no block of {spec.block_size} tokens "
            f"({spec.bytes_per_block} bytes each for this model); give more"
        )
    return int(blocks)


def allocate_kv_caches(spec: KvCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    # Uninitialized: every slot is written before it is read.
    return [torch.empty(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
