"""The embedding cache on its own (engine/core/output_cache.py): its key, its byte bound, and identical
sequences in flight running once, also when the call running them fails or goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedserv.engine.core.output_cache import (
    ENTRY_OVERHEAD_BYTES,
    KEY_BYTES,
    OutputCache,
    cache_key,
    entry_bytes,
)
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import SequenceOutput
from embedserv.types import EmbedOutput


def _row(width: int, value: float = 1.0) -> SequenceOutput:
    return SequenceOutput(np.full(width, value, dtype=np.float32), 1.0, 2.0)


def _key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


class CountingModel:
    """Stands in for the scheduler: records every batch of requests it was asked to run."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None) -> None:
        self.batches: list[list[str]] = []
        self.delay = delay
        self.fail = fail
        self.started = asyncio.Event()

    @property
    def sequences(self) -> list[str]:
        return [r for batch in self.batches for r in batch]

    async def __call__(self, requests: list[str]) -> list[SequenceOutput]:
        self.batches.append(list(requests))
        self.started.set()
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return [SequenceOutput(np.array([float(len(r)), hash(r) % 997], dtype=np.float32), 0.0, 0.0) for r in requests]


def _keys(texts: list[str]) -> list[bytes]:
    return [cache_key(InputSequence(ids=[ord(c) for c in text]), ()) for text in texts]


# The key


def test_every_field_of_encoded_changes_the_key():
    base = InputSequence(ids=[101, 7, 8, 102], pool_start=1, token_type_ids=[0, 0, 1, 1], adapter=0)
    changed = {
        "ids": [101, 7, 9, 102],
        "pool_start": 2,
        "token_type_ids": [0, 1, 1, 1],
        "adapter": 1,
        "pixels": np.zeros((4, 3), dtype=np.float32),
        "image_grids": ((2, 2),),
    }
    # A field added to InputSequence later must be listed here, so this test says whether it reaches the key.
    assert set(changed) == {f.name for f in dataclasses.fields(InputSequence)}
    keys = {cache_key(base, ())}
    for name, value in changed.items():
        keys.add(cache_key(dataclasses.replace(base, **{name: value}), ()))
    assert len(keys) == 1 + len(changed)
    assert cache_key(dataclasses.replace(base, token_type_ids=None), ()) != cache_key(base, ())
    # Pixels: one value, or the same bytes in another shape, is another image.
    image = dataclasses.replace(base, pixels=np.zeros((4, 3), dtype=np.float32))
    other_pixel = np.zeros((4, 3), dtype=np.float32)
    other_pixel[3, 2] = 1e-6
    keys = {
        cache_key(image, ()),
        cache_key(dataclasses.replace(image, pixels=other_pixel), ()),
        cache_key(dataclasses.replace(image, pixels=np.zeros((3, 4), dtype=np.float32)), ()),
    }
    assert len(keys) == 3


def test_outputs_wanted_change_the_key_but_not_their_order():
    encoded = InputSequence(ids=[1, 2, 3])
    dense, sparse, multi = EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR
    assert cache_key(encoded, ()) == cache_key(encoded, (dense,))
    assert cache_key(encoded, (dense, sparse)) == cache_key(encoded, (sparse, dense))
    assert len({cache_key(encoded, w) for w in [(dense,), (sparse,), (multi,), (dense, sparse)]}) == 4


@given(st.lists(st.integers(0, 2**40), max_size=20), st.lists(st.integers(0, 2**40), max_size=20))
def test_ids_split_differently_never_collide(a, b):
    """Length-prefixed fields: the same numbers spread differently over ids and token types differ."""
    one = InputSequence(ids=a + b, token_type_ids=b)
    two = InputSequence(ids=a, token_type_ids=a + b)
    if (one.ids, one.token_type_ids) != (two.ids, two.token_type_ids):
        assert cache_key(one, ()) != cache_key(two, ())


# The byte bound


def test_entry_size_counts_arrays_key_and_overhead():
    sparse = SequenceOutput(None, 0.0, 0.0, (np.zeros(5, np.float32), np.zeros(5, np.int64)))
    assert entry_bytes(sparse) == 5 * 4 + 5 * 8 + KEY_BYTES + ENTRY_OVERHEAD_BYTES
    assert entry_bytes(_row(384)) == 384 * 4 + KEY_BYTES + ENTRY_OVERHEAD_BYTES


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 20_000), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1500)), max_size=80))
def test_eviction_keeps_the_byte_bound_and_evicts_least_recently_used(capacity, operations):
    cache = OutputCache(capacity)
    model: dict[bytes, int] = {}  # key -> size, least recently used first
    for i, width in operations:
        key = _key(i)
        if width % 3 == 0:  # a read
            got = cache.get(key)
            assert (got is not None) == (key in model)
            if key in model:
                model[key] = model.pop(key)
            continue
        output = _row(width)
        size = entry_bytes(output)
        cache.put(key, output)
        if size <= capacity and key not in model:
            model[key] = size
            while sum(model.values()) > capacity:
                model.pop(next(iter(model)))
        assert cache.stats.bytes <= capacity
        assert cache.stats.bytes == sum(model.values())
        assert cache.stats.entries == len(model)
        assert list(cache._entries) == list(model)


def test_an_entry_larger_than_the_cache_is_not_stored_and_evicts_nothing():
    small = _row(10)
    cache = OutputCache(entry_bytes(small) * 2)
    cache.put(_key(1), small)
    cache.put(_key(2), _row(1000))
    assert cache.get(_key(2)) is None and cache.get(_key(1)) is not None
    assert cache.stats.evictions == 0 and cache.stats.entries == 1


def test_evictions_are_counted():
    row = _row(10)
    cache = OutputCache(entry_bytes(row) * 3)
    for i in range(10):
        cache.put(_key(i), row)
    assert cache.stats.entries == 3 and cache.stats.evictions == 7
    assert [cache.get(_key(i)) is not None for i in range(10)] == [False] * 7 + [True] * 3


def test_stored_arrays_are_private_read_only_copies():
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    output = SequenceOutput(batch[1], 0.0, 0.0, (np.ones(2, np.float32), np.arange(2)), np.ones((2, 4), np.float32))
    cache = OutputCache(10**6)
    cache.put(_key(1), output)
    batch[1] = -1  # the batch the row came from is reused
    got = cache.get(_key(1))
    assert got.row.tolist() == [4.0, 5.0, 6.0, 7.0]
    assert got.row.base is None or got.row.base.nbytes == got.row.nbytes  # no view of the whole batch
    for array in (got.row, got.vectors, *got.sparse):
        with pytest.raises(ValueError):
            array[0] = 0


# In flight


def test_identical_sequences_in_one_call_run_once():
    async def run():
        cache, model = OutputCache(10**6), CountingModel()
        texts = ["a", "bb", "a", "ccc", "bb", "a"]
        outputs, computed = await cache.run(texts, _keys(texts), model)
        return cache, model, outputs, computed

    cache, model, outputs, computed = asyncio.run(run())
    assert model.sequences == ["a", "bb", "ccc"]
    assert len(computed) == 3
    assert [o.row[0] for o in outputs] == [1, 2, 1, 3, 2, 1]
    assert (cache.stats.hits, cache.stats.misses) == (3, 3)


def test_a_second_call_is_answered_from_the_cache():
    async def run():
        cache, model = OutputCache(10**6), CountingModel()
        first, _ = await cache.run(["a", "b"], _keys(["a", "b"]), model)
        second, computed = await cache.run(["b", "c", "a"], _keys(["b", "c", "a"]), model)
        return cache, model, first, second, computed

    cache, model, first, second, computed = asyncio.run(run())
    assert model.batches == [["a", "b"], ["c"]]
    assert len(computed) == 1
    assert second[0].row.tobytes() == first[1].row.tobytes() and second[2].row.tobytes() == first[0].row.tobytes()
    assert (cache.stats.hits, cache.stats.misses, cache.stats.entries) == (2, 3, 3)


def test_concurrent_identical_calls_run_the_model_once():
    async def run():
        cache, model = OutputCache(10**6), CountingModel(delay=0.05)
        texts = ["x", "y", "z"]
        results = await asyncio.gather(*(cache.run(texts, _keys(texts), model) for _ in range(8)))
        return cache, model, results

    cache, model, results = asyncio.run(run())
    assert sorted(model.sequences) == ["x", "y", "z"]
    assert all([o.row.tobytes() for o in r[0]] == [o.row.tobytes() for o in results[0][0]] for r in results)
    # Every call's timing covers the three sequences: it ran them or waited for them.
    assert all(len(ran) == 3 for _, ran in results)
    assert (cache.stats.hits, cache.stats.misses) == (21, 3)
    first, second = results[0][0][0], results[1][0][0]
    assert first.row is not second.row or not first.row.flags.writeable, "two calls share a writable array"


def test_waiters_get_the_failure_of_the_call_that_ran_their_sequence():
    async def run():
        cache, model = OutputCache(10**6), CountingModel(delay=0.05, fail=RuntimeError("inference failed: boom"))
        calls = [cache.run(["a"], _keys(["a"]), model) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        return cache, model, results

    cache, model, results = asyncio.run(run())
    assert len(model.batches) == 1
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) for r in results)
    assert cache.stats.entries == 0 and not cache._pending


def test_when_the_running_call_is_cancelled_a_waiter_runs_the_sequence():
    async def run():
        cache, model = OutputCache(10**6), CountingModel(delay=0.1)
        owner = asyncio.create_task(cache.run(["a"], _keys(["a"]), model))
        await model.started.wait()
        waiter = asyncio.create_task(cache.run(["a", "b"], _keys(["a", "b"]), model))
        await asyncio.sleep(0.01)
        owner.cancel()
        outputs, computed = await asyncio.wait_for(waiter, 5)
        return cache, model, owner, outputs, computed

    cache, model, owner, outputs, computed = asyncio.run(run())
    assert owner.cancelled()
    assert model.batches == [["a"], ["b"], ["a"]]
    assert [o.row[0] for o in outputs] == [1, 1] and len(computed) == 2
    assert cache.get(_keys(["a"])[0]) is not None and not cache._pending


def test_a_cancelled_waiter_leaves_the_running_call_alone():
    async def run():
        cache, model = OutputCache(10**6), CountingModel(delay=0.1)
        owner = asyncio.create_task(cache.run(["a"], _keys(["a"]), model))
        await model.started.wait()
        waiter = asyncio.create_task(cache.run(["a"], _keys(["a"]), model))
        await asyncio.sleep(0.01)
        waiter.cancel()
        outputs, _ = await asyncio.wait_for(owner, 5)
        return model, waiter, outputs

    model, waiter, outputs = asyncio.run(run())
    assert waiter.cancelled() and outputs[0].row[0] == 1 and len(model.batches) == 1


def test_random_concurrent_calls_each_get_their_own_answers():
    async def run():
        rng = random.Random(0)
        cache, model = OutputCache(4 * entry_bytes(_row(2))), CountingModel(delay=0.001)
        calls = [[rng.choice("abcdefgh") * rng.randint(1, 3) for _ in range(rng.randint(1, 6))] for _ in range(40)]
        results = await asyncio.gather(*(cache.run(texts, _keys(texts), model) for texts in calls))
        return calls, results, cache

    calls, results, cache = asyncio.run(run())
    for texts, (outputs, _) in zip(calls, results, strict=True):
        assert [o.row[0] for o in outputs] == [len(t) for t in texts]
    assert cache.stats.bytes <= cache.stats.capacity_bytes and not cache._pending
