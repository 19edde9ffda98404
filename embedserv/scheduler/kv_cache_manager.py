"""Block tables of every KV-cache group of a model, for the generation scheduler. No torch here.

A model's attention layers fall into KV-cache groups (worker/kv_cache.py builds the specs): layers of one
group share block size and block tables, so one BlockManager serves each group. A request holds one block
table per group. Two kinds of group:
- growing (decoder self-attention): the table covers the tokens computed so far and grows with them; full
  blocks may be prefix-cached;
- fixed (cross-attention): sized once at admission from the request's encoder input, written in its first
  step, read-only after, never prefix-cached.
Every group has the same number of blocks (the memory is split so, see worker/kv_cache.py), and a request
is admitted only when every group can take it. An encoder-decoder request's decoder keys and values depend
on its encoder input, so its cached prefix chain starts from a hash of that input: requests with different
encoder inputs share no decoder block.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedserv.scheduler.block_manager import BlockManager
from embedserv.scheduler.request import Request


@dataclass(frozen=True)
class KvGroup:
    block_size: int
    fixed: bool = False


class KvCacheManager:
    def __init__(self, groups: list[KvGroup], num_blocks: int, enable_prefix_caching: bool = False) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.groups = tuple(groups)
        growing = [g for g in groups if not g.fixed]
        # One cached prefix must be valid for every growing group at once; with one such group it is.
        self.enable_prefix_caching = enable_prefix_caching and len(growing) == 1
        self.managers = [
            BlockManager(num_blocks, g.block_size, self.enable_prefix_caching and not g.fixed) for g in groups
        ]
        self._growing = [(index, g.block_size) for index, g in enumerate(groups) if not g.fixed]

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_used_blocks(self) -> int:
        return sum(m.num_used_blocks for m in self.managers)

    @property
    def block_size(self) -> int:
        """The block size of the first growing group (what prefix caching and ListModels report)."""
        return self._cached_group()[1].block_size

    def blocks_needed(self, request: Request, num_tokens: int) -> list[int]:
        """Blocks per group for a table covering `num_tokens` decoder tokens."""
        encoder_len = len(request.encoder_token_ids)
        return [
            m.blocks_needed(encoder_len if g.fixed else num_tokens)
            for g, m in zip(self.groups, self.managers, strict=True)
        ]

    def can_ever_fit(self, request: Request, num_tokens: int) -> bool:
        return all(
            n <= m.num_blocks for n, m in zip(self.blocks_needed(request, num_tokens), self.managers, strict=True)
        )

    def covers(self, request: Request, num_tokens: int) -> bool:
        """Every table of the request already holds `num_tokens` tokens: the common decode step, which then
        needs no allocation. Fixed tables are whole from admission on."""
        tables = request.block_ids
        return bool(tables) and all(
            len(tables[index]) * block_size >= num_tokens for index, block_size in self._growing
        )

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        tables = request.block_ids or [[] for _ in self.groups]
        return all(
            n - len(table) <= m.num_free_blocks
            for n, table, m in zip(self.blocks_needed(request, num_tokens), tables, self.managers, strict=True)
        )

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grows every table of the request to cover `num_tokens` (fixed tables: their whole size)."""
        if not request.block_ids:
            request.block_ids = [[] for _ in self.groups]
        if not self.can_allocate(request, num_tokens):
            raise ValueError("allocate() without can_allocate()")
        for group, manager, table in zip(self.groups, self.managers, request.block_ids, strict=True):
            manager.allocate(table, len(request.encoder_token_ids) if group.fixed else num_tokens)

    def free(self, request: Request) -> None:
        # A request that never got blocks (still waiting, or finished before its admission) has no tables.
        for manager, table in zip(self.managers, request.block_ids, strict=True) if request.block_ids else ():
            manager.free(table)
        request.block_ids = []

    def allocate_cached_prefix(self, request: Request, token_ids: list[int]) -> int:
        """Takes the cached full blocks the request's leading tokens match; returns the tokens they cover."""
        if not self.enable_prefix_caching:
            return 0
        index, manager = self._cached_group()
        request.block_ids = [[] for _ in self.groups]
        return manager.allocate_cached_prefix(request.block_ids[index], token_ids, _root_hash(request))

    def register_full_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        index, manager = self._cached_group()
        manager.register_full_blocks(
            request.block_ids[index], request.all_token_ids(), request.num_computed_tokens, _root_hash(request)
        )

    def check_invariants(self) -> None:
        for manager in self.managers:
            manager.check_invariants()

    def _cached_group(self) -> tuple[int, BlockManager]:
        index = next(i for i, g in enumerate(self.groups) if not g.fixed)
        return index, self.managers[index]


def _root_hash(request: Request) -> int | None:
    """The hash a request's decoder prefix chain starts from: its encoder input's (computed once)."""
    if not request.encoder_token_ids:
        return None
    if request.encoder_hash is None:
        request.encoder_hash = hash(("encoder", tuple(request.encoder_token_ids)))
    return request.encoder_hash


@dataclass(frozen=True)
class KvCacheLayout:
    """What a worker's KV cache holds, as the scheduler side needs it: blocks in every group, and the groups."""

    num_blocks: int
    groups: tuple[KvGroup, ...]
