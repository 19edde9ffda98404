"""The paged-KV block manager: allocation, refcounts, prefix caching, LRU eviction. No torch here."""

import random
import subprocess
import sys

import pytest

from embedserv.scheduler.block_manager import BlockManager, NoFreeBlocks


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _computed(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """A table holding token_ids with their KV computed and full blocks registered."""
    table: list[int] = []
    bm.allocate(table, len(token_ids))
    bm.register_full_blocks(table, token_ids, len(token_ids))
    return table


def test_blocks_needed_rounds_up():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_in_place():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.allocate(table, 5)
    assert len(table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    first_two = list(table)
    bm.allocate(table, 8)  # still fits in two blocks
    assert table == first_two
    bm.append_slot(table, 9)
    assert table[:2] == first_two and len(table) == 3
    assert len(set(table)) == 3
    bm.check_invariants()


def test_no_free_blocks_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    table: list[int] = []
    bm.allocate(table, 4)
    before = (list(table), bm.num_free_blocks, bm.num_used_blocks)
    assert not bm.can_allocate(table, 13)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(table, 13)
    assert (list(table), bm.num_free_blocks, bm.num_used_blocks) == before
    assert bm.can_allocate(table, 8)
    bm.allocate(table, 8)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_free_returns_blocks_and_clears_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = [], []
    bm.allocate(a, 9)
    bm.allocate(b, 4)
    bm.free(a)
    assert a == [] and bm.num_used_blocks == 1 and bm.num_free_blocks == 5
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.free([0])


def test_caching_off_is_a_no_op():
    bm = BlockManager(num_blocks=6, block_size=2)
    tokens = _tokens(6)
    table = _computed(bm, tokens)
    bm.free(table)
    other: list[int] = []
    assert bm.allocate_cached_prefix(other, tokens) == 0
    assert other == [] and bm.num_used_blocks == 0
    bm.check_invariants()


def test_shared_prefix_takes_references():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(10)  # two full blocks and a partial one
    first = _computed(bm, tokens)
    second: list[int] = []
    assert bm.allocate_cached_prefix(second, tokens) == 8
    assert second == first[:2]
    assert [bm.ref_count(b) for b in first] == [2, 2, 1]
    assert bm.num_used_blocks == 3
    bm.check_invariants()
    bm.free(first)
    assert [bm.ref_count(b) for b in second] == [1, 1]
    assert bm.num_used_blocks == 2
    shared = list(second)
    bm.free(second)
    assert bm.num_used_blocks == 0
    # Unreferenced cached blocks still count as free.
    assert bm.num_free_blocks == 8
    third: list[int] = []
    assert bm.allocate_cached_prefix(third, tokens) == 8
    assert third == shared
    bm.check_invariants()


def test_only_full_blocks_match():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(7)
    table = _computed(bm, tokens)  # one full block registered, the partial one not
    full, partial = table
    bm.free(table)
    assert bm.is_cached(full) and not bm.is_cached(partial)
    probe: list[int] = []
    assert bm.allocate_cached_prefix(probe, tokens) == 4
    bm.free(probe)
    # A query shorter than one full block matches nothing.
    assert bm.allocate_cached_prefix(probe, tokens[:3]) == 0
    assert probe == []


def test_uncomputed_blocks_are_not_registered():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(12)
    table: list[int] = []
    bm.allocate(table, 12)
    bm.register_full_blocks(table, tokens, num_computed_tokens=5)
    bm.free(table)
    probe: list[int] = []
    assert bm.allocate_cached_prefix(probe, tokens) == 4


def test_hashes_are_chained():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.free(_computed(bm, [1, 2, 3, 4]))
    bm.free(_computed(bm, [9, 9, 5, 6]))
    probe: list[int] = []
    # [3, 4] is cached, but after [1, 2]: behind [9, 9] it must not match.
    assert bm.allocate_cached_prefix(probe, [9, 9, 3, 4]) == 2
    bm.free(probe)
    # Same first block, different second one: only the first matches.
    assert bm.allocate_cached_prefix(probe, [1, 2, 4, 3]) == 2
    bm.free(probe)
    assert bm.allocate_cached_prefix(probe, [1, 2, 3, 4, 5]) == 4
    bm.free(probe)
    assert bm.allocate_cached_prefix(probe, [3, 4]) == 0
    bm.check_invariants()


def test_eviction_takes_least_recently_freed_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _computed(bm, [1, 1])
    b = _computed(bm, [2, 2])
    c = _computed(bm, [3, 3])
    bm.free(b)
    bm.free(a)
    bm.free(c)  # LRU order now: b, a, c
    assert bm.num_free_blocks == 4
    fresh: list[int] = []
    bm.allocate(fresh, 4)  # the plain free block, then b's
    probe: list[int] = []
    assert bm.allocate_cached_prefix(probe, [2, 2]) == 0
    assert bm.allocate_cached_prefix(probe, [1, 1]) == 2
    bm.free(probe)
    bm.free(fresh)
    bm.check_invariants()


def test_referenced_cached_block_is_never_evicted():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    bm.free(_computed(bm, [1, 1]))
    holder: list[int] = []
    assert bm.allocate_cached_prefix(holder, [1, 1]) == 2
    other: list[int] = []
    bm.allocate(other, 4)
    assert set(other).isdisjoint(holder)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(other, 6)
    assert bm.ref_count(holder[0]) == 1
    bm.check_invariants()


def test_duplicate_computation_keeps_one_cached_copy():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = _computed(bm, [5, 6, 7, 8])
    b = _computed(bm, [5, 6, 7, 8])  # computed concurrently, not shared
    assert set(a).isdisjoint(b)
    first_copy = list(a)
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    probe: list[int] = []
    assert bm.allocate_cached_prefix(probe, [5, 6, 7, 8]) == 4
    assert probe == first_copy
    bm.free(probe)


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    table = _computed(bm, [1, 2])
    bm.check_invariants()
    bm._ref_counts[table[0]] = 0  # referenced but not in any free pool
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_random_operations_keep_invariants():
    for seed in range(3):
        rng = random.Random(seed)
        bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
        prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
        tables: list[tuple[list[int], list[int]]] = []
        for _ in range(1500):
            if tables and rng.random() < 0.4:
                table, _ = tables.pop(rng.randrange(len(tables)))
                bm.free(table)
            else:
                tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 9))]
                table = []
                cached = bm.allocate_cached_prefix(table, tokens)
                assert cached % 4 == 0 and cached <= len(tokens)
                if bm.can_allocate(table, len(tokens)):
                    bm.allocate(table, len(tokens))
                    bm.register_full_blocks(table, tokens, len(tokens))
                    tables.append((table, tokens))
                else:
                    bm.free(table)
            bm.check_invariants()
            owners = [b for table, _ in tables for b in table]
            assert sum(bm.ref_count(b) for b in range(16)) == len(owners)
            for block in set(owners):
                assert bm.ref_count(block) == owners.count(block)
        for table, _ in tables:
            bm.free(table)
        assert bm.num_used_blocks == 0


def test_block_manager_imports_no_torch():
    code = "import sys, embedserv.scheduler.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
