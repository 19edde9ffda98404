"""The embedding cache of one served model (`--embedding-cache SIZE`): sequence outputs the model already
computed, by what its forward pass saw, in an LRU bounded in bytes.

It sits at LocalCore.infer, which every task (embed, rerank, classify, chunking) calls, so a key needs only
what reaches the workers: the sequence (all of InputSequence's fields, its ids after the core strips padding) and
the outputs wanted. The model is implicit (one cache per engine core). What a task does after the forward
pass (dimensions, normalization, encodings, sparse top-k, activations) runs on the cached output each time,
as on a computed one, so a hit gives the bytes the miss gave. With `--frontends N` the cache lives in the
engine process: every front end shares it.

Identical keys in flight run once, within one call and across calls: the first asks the scheduler and the
others wait for its answer. If that call fails, they fail with it (they would have run the same sequence);
if it is cancelled, one of them runs the sequence instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import SequenceOutput
from embedserv.scheduler.request import Request
from embedserv.types import EmbedOutput

# Bytes an entry costs beyond its arrays' data and its key's digest: the key object, the dict slot and its
# link, the SequenceOutput and the arrays' headers (tracemalloc: about 390 for a dense row, 560 for sparse's
# two arrays).
ENTRY_OVERHEAD_BYTES = 576
# A digest, not the ids themselves: keys stay 32 bytes however long the input (a 512-token key would be
# larger than its 384-float row), and 256 bits make a collision far less likely than a flipped memory bit.
KEY_BYTES = 32

Compute = Callable[[list[Request]], Awaitable[list[SequenceOutput]]]


@dataclass
class CacheStats:
    """Since the start. `hits` counts sequences answered without running them (stored, or run once for
    several sequences in flight); `misses`, the sequences the cache sent to the model."""

    capacity_bytes: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


def cache_key(encoded: InputSequence, wanted: tuple[EmbedOutput, ...]) -> bytes:
    """Everything the forward pass of one sequence sees: every field of InputSequence, by name (a field added to it
    later joins the key by itself), and the outputs wanted in a canonical order."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    for field in dataclasses.fields(encoded):
        _feed(digest, field.name, getattr(encoded, field.name))
    outputs = sorted({output.value for output in wanted} or {EmbedOutput.DENSE.value})
    _feed(digest, "wanted", outputs)
    return digest.digest()


def _feed(digest, name: str, value: object) -> None:
    """Length-prefixed parts, so that no two different sequences of fields serialize alike."""
    for part in (name.encode(), _serialized(value)):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


def _serialized(value: object) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, np.ndarray):
        # An image's pixels: dtype and shape, then the bytes.
        return b"A" + repr((value.dtype.str, value.shape)).encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, (list, tuple)) and value:
        try:
            ints = np.asarray(value)
        except (OverflowError, ValueError):
            ints = None
        if ints is not None and ints.dtype.kind == "i" and ints.ndim == 1:
            # Token ids: their int64 bytes are far quicker to hash than their repr.
            return b"I" + ints.astype(np.int64).tobytes()
    return b"R" + repr(value).encode()


def _frozen(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else _frozen_array(array)


def _frozen_array(array: np.ndarray) -> np.ndarray:
    """A copy that owns its memory (a row is a view of its whole batch) and that nobody can write to."""
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy


def stored(output: SequenceOutput) -> SequenceOutput:
    sparse = output.sparse
    return SequenceOutput(
        _frozen(output.row),
        output.started,
        output.finished,
        (_frozen_array(sparse[0]), _frozen_array(sparse[1])) if sparse is not None else None,
        _frozen(output.vectors),
        output.batch_sequences,
        output.batch_tokens,
    )


def entry_bytes(output: SequenceOutput) -> int:
    arrays = [output.row, output.vectors, *(output.sparse or ())]
    return sum(a.nbytes for a in arrays if a is not None) + KEY_BYTES + ENTRY_OVERHEAD_BYTES


class _OwnerGone:
    """The result of a key whose computing call was cancelled: its waiters run it themselves."""


_GONE = _OwnerGone()


class OutputCache:
    """Lives on the engine's event loop; not thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.stats = CacheStats(capacity_bytes)
        self._entries: OrderedDict[bytes, tuple[SequenceOutput, int]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future] = {}

    def get(self, key: bytes) -> SequenceOutput | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, output: SequenceOutput) -> SequenceOutput:
        """Stores a read-only copy of `output` unless it alone is larger than the cache, evicting the least
        recently used entries until the total fits; returns the copy."""
        frozen = stored(output)
        size = entry_bytes(frozen)
        if size > self.stats.capacity_bytes or key in self._entries:
            return frozen
        self._entries[key] = (frozen, size)
        self.stats.bytes += size
        while self.stats.bytes > self.stats.capacity_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.stats.bytes -= evicted
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)
        return frozen

    async def run(
        self, requests: list[Request], keys: list[bytes], compute: Compute
    ) -> tuple[list[SequenceOutput], list[SequenceOutput]]:
        """Each request's output, in order, from the cache, from an identical sequence in flight, or from
        `compute` (the scheduler) for the rest; and the outputs of the sequences that ran while this call
        waited, its own and those it waited for (its timing)."""
        found: dict[bytes, SequenceOutput] = {}
        ran: list[SequenceOutput] = []
        own = 0
        unique = set(keys)
        while len(found) < len(unique):
            todo: dict[bytes, Request] = {}
            waits: dict[bytes, asyncio.Future] = {}
            for key, request in zip(keys, requests, strict=True):
                if key in found or key in todo or key in waits:
                    continue
                cached = self.get(key)
                if cached is not None:
                    found[key] = cached
                elif key in self._pending:
                    waits[key] = self._pending[key]
                else:
                    todo[key] = request
            if todo:
                outputs = await self._compute(todo, compute)
                found.update(zip(todo, outputs, strict=True))
                ran += outputs
                own += len(outputs)
            for key, future in waits.items():
                # Shielded: this call going away must not cancel another call's sequence.
                output = await asyncio.shield(future)
                if output is not _GONE:
                    found[key] = output
                    ran.append(output)
        self.stats.hits += len(keys) - own
        return [found[key] for key in keys], ran

    async def _compute(self, todo: dict[bytes, Request], compute: Compute) -> list[SequenceOutput]:
        loop = asyncio.get_running_loop()
        futures = {key: loop.create_future() for key in todo}
        self._pending.update(futures)
        self.stats.misses += len(todo)
        try:
            outputs = await compute(list(todo.values()))
        except BaseException as exc:
            for key, future in futures.items():
                del self._pending[key]
                if isinstance(exc, asyncio.CancelledError):
                    future.set_result(_GONE)
                else:
                    future.set_exception(exc)
                    future.exception()  # retrieved: no "never retrieved" log when nobody waited
            raise
        for (key, future), output in zip(futures.items(), outputs, strict=True):
            del self._pending[key]
            # Waiters share the read-only copy: another call's results never alias this call's arrays.
            future.set_result(self.put(key, output))
        return outputs
