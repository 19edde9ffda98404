"""Paged-KV block allocation with reference counts and prefix caching of full blocks. No torch here.

A sequence owns a block table: a list of block ids, block i holding its tokens
[i * block_size, (i + 1) * block_size). Full blocks whose KV has been computed can be registered
under a chained hash (the hash of a block covers every token before it), so a later sequence with
the same leading tokens takes references to them instead of recomputing them.

A block is in exactly one of three states:
- referenced (refcount > 0), possibly registered under a hash;
- cached free (refcount 0, still registered): reusable by a prefix match, evictable, LRU order;
- plain free (refcount 0, no hash).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class NoFreeBlocks(Exception):
    """The allocation needs more blocks than are free; nothing was changed."""


def _require(condition: bool, message: str) -> None:
    # Explicit raise rather than `assert`, so the check survives `python -O`.
    if not condition:
        raise AssertionError(message)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # The chained hash of the tokens a block holds; None while unregistered.
        self._block_hashes: list[int | None] = [None] * num_blocks
        # One block per hash: the block a prefix match hands out.
        self._hash_to_block: dict[int, int] = {}
        self._plain_free: deque[int] = deque(range(num_blocks))
        # Least recently freed first: the eviction order.
        self._cached_free: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """True when a prefix match can hand this block out."""
        block_hash = self._block_hashes[block_id]
        return block_hash is not None and self._hash_to_block.get(block_hash) == block_id

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_ids) <= self.num_free_blocks

    def allocate(self, block_ids: list[int], num_tokens: int) -> None:
        """Appends new blocks to `block_ids` until it holds `num_tokens` tokens."""
        num_new = self.blocks_needed(num_tokens) - len(block_ids)
        if num_new <= 0:
            return
        if num_new > self.num_free_blocks:
            raise NoFreeBlocks(f"need {num_new} blocks, {self.num_free_blocks} free")
        for _ in range(num_new):
            block_ids.append(self._pop_free_block())

    def append_slot(self, block_ids: list[int], num_tokens: int) -> None:
        """The decode step's growth by one token: the same as allocate()."""
        self.allocate(block_ids, num_tokens)

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference to each block and clears the table."""
        # Tail first: a sequence's last blocks are the least likely to be shared, so they become
        # the least recently freed and are evicted before the prefix they extend.
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._release(block_id)
        block_ids.clear()

    def allocate_cached_prefix(
        self, block_ids: list[int], token_ids: Sequence[int], root_hash: int | None = None
    ) -> int:
        """Takes references to the cached full blocks matching the leading tokens of a new sequence.

        `root_hash` starts the chain: what the tokens' keys and values depend on besides the tokens (an
        encoder-decoder request's encoder input); sequences with different roots share no block.
        Returns the number of tokens they cover (a multiple of block_size).
        """
        if not self.enable_prefix_caching:
            return 0
        if block_ids:
            raise ValueError("a cached prefix only starts an empty block table")
        parent_hash = root_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            block_hash = hash((parent_hash, tuple(token_ids[start : start + size])))
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            if self._ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1
            block_ids.append(block_id)
            parent_hash = block_hash
        return len(block_ids) * size

    def register_full_blocks(
        self, block_ids: list[int], token_ids: Sequence[int], num_computed_tokens: int, root_hash: int | None = None
    ) -> None:
        """Records the chained hash of each computed full block that has none yet."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(num_computed_tokens // size, len(block_ids))
        if len(token_ids) < num_full * size:
            raise ValueError("token_ids is shorter than the computed blocks")
        # Registered blocks always form a prefix of a table (registration goes in order and a cached
        # prefix is contiguous), so scan back only over the new ones.
        first_new = num_full
        while first_new > 0 and self._block_hashes[block_ids[first_new - 1]] is None:
            first_new -= 1
        parent_hash = self._block_hashes[block_ids[first_new - 1]] if first_new else root_hash
        for index in range(first_new, num_full):
            block_id = block_ids[index]
            block_hash = hash((parent_hash, tuple(token_ids[index * size : (index + 1) * size])))
            self._block_hashes[block_id] = block_hash
            # Another sequence may have computed the same tokens into its own block: keep the first,
            # the duplicate keeps its hash only so its successors can chain from it.
            self._hash_to_block.setdefault(block_hash, block_id)
            parent_hash = block_hash

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping contradicts itself. For tests."""
        plain, cached = set(self._plain_free), set(self._cached_free)
        _require(len(plain) == len(self._plain_free), "a block is twice in the free list")
        _require(not plain & cached, "a block is both plain free and cached free")
        for block_id, count in enumerate(self._ref_counts):
            block_hash = self._block_hashes[block_id]
            _require(count >= 0, f"block {block_id} has refcount {count}")
            is_free = block_id in plain or block_id in cached
            _require(is_free == (count == 0), f"block {block_id}: refcount {count}, free {is_free}")
            if block_id in plain:
                _require(block_hash is None, f"plain free block {block_id} keeps a hash")
            if block_id in cached:
                _require(self.is_cached(block_id), f"cached free block {block_id} is not in the hash table")
            if block_hash is not None:
                _require(self.enable_prefix_caching, f"block {block_id} hashed with caching off")
        for block_hash, block_id in self._hash_to_block.items():
            stored = self._block_hashes[block_id]
            _require(stored == block_hash, f"hash table points at block {block_id} holding {stored}")
        used = sum(1 for count in self._ref_counts if count > 0)
        _require(used == self.num_used_blocks, "used count disagrees with refcounts")
        _require(used + self.num_free_blocks == self.num_blocks, "blocks lost or duplicated")

    def _pop_free_block(self) -> int:
        if self._plain_free:
            block_id = self._plain_free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            block_hash = self._block_hashes[block_id]
            if block_hash is None:
                raise AssertionError("a cached free block has no hash")
            del self._hash_to_block[block_hash]
            self._block_hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        """Returns an unreferenced block to the pool, cached while a prefix match can still use it."""
        block_hash = self._block_hashes[block_id]
        if block_hash is not None and self._hash_to_block.setdefault(block_hash, block_id) == block_id:
            self._cached_free[block_id] = None
        else:
            self._block_hashes[block_id] = None
            self._plain_free.append(block_id)
