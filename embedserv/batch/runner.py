"""`embedserv batch`'s loop: rows in shards, each shard's texts sorted by length and embedded in concurrent calls
to the in-process engine, written in input order (outputs.py), with progress (progress.py).

Two shards are in flight at most: the next one's calls fill the engine's queue while the last calls of the one
before finish, and memory holds two shards whatever the corpus size. A call that fails on its inputs
(InvalidInput: too long without --truncate, an image that does not decode) is retried one row at a time, so only
the bad rows go to the errors file.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from embedserv.batch.inputs import Row
from embedserv.batch.outputs import ShardWriter, vectors_table
from embedserv.batch.progress import Progress
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.types import EmbedParams, ImageInput


@dataclass(frozen=True)
class ShardDone:
    first_row: int
    rows: int
    table: object
    errors: list[dict]
    tokens: int


async def run_shards(shards: Iterable[asyncio.Future], writer: ShardWriter, progress: Progress) -> None:
    """Writes each shard's result in order, keeping at most two in flight (`shards` starts them lazily)."""
    pending: deque[asyncio.Future] = deque()
    for shard in shards:
        pending.append(shard)
        if len(pending) >= 2:
            _write(await pending.popleft(), writer, progress)
    while pending:
        _write(await pending.popleft(), writer, progress)
    writer.finish()


def _write(done: ShardDone, writer: ShardWriter, progress: Progress) -> None:
    writer.write(done.first_row, done.rows, done.table, done.errors)
    progress.update(done.rows, done.tokens, len(done.errors))


def shards_of(rows: Iterator[Row], shard_rows: int) -> Iterator[list[Row]]:
    while shard := list(itertools.islice(rows, shard_rows)):
        yield shard


class TextEmbedder:
    """Embeds shards of rows with `engine`, `call_size` rows a call, `concurrency` calls in flight."""

    def __init__(self, engine: Engine, params: EmbedParams, call_size: int, concurrency: int, ids: bool) -> None:
        self.engine = engine
        self.params = params
        self.call_size = call_size
        self.ids = ids
        self._calls = asyncio.Semaphore(concurrency)

    def start(self, shard: list[Row]) -> asyncio.Task:
        return asyncio.create_task(self._shard(shard))

    async def _shard(self, shard: list[Row]) -> ShardDone:
        good = [row for row in shard if row.error is None]
        errors = [_error(row, row.error) for row in shard if row.error is not None]
        # Similar lengths in one call: its sequences finish together, so calls free the queue evenly.
        order = sorted(range(len(good)), key=lambda i: _length(good[i].item))
        groups = [order[i : i + self.call_size] for i in range(0, len(order), self.call_size)]
        outcomes = await asyncio.gather(*(self._group([good[i] for i in group]) for group in groups))
        vectors: dict[int, np.ndarray] = {}
        tokens = 0
        for group, (rows_vectors, row_errors, group_tokens) in zip(groups, outcomes, strict=True):
            tokens += group_tokens
            for i, vector, error in zip(group, rows_vectors, row_errors, strict=True):
                if error is None:
                    vectors[i] = vector
                else:
                    errors.append(_error(good[i], error))
        kept = sorted(vectors)
        matrix = np.stack([vectors[i] for i in kept]) if kept else np.zeros((0, 0), np.float32)
        ids = [good[i].id or "" for i in kept] if self.ids else None
        table = vectors_table([good[i].index for i in kept], ids, matrix)
        errors.sort(key=lambda e: e["row"])
        return ShardDone(shard[0].index, len(shard), table, errors, tokens)

    async def _group(self, rows: list[Row]) -> tuple[list, list[str | None], int]:
        """(each row's vector or None, each row's error or None, tokens)."""
        async with self._calls:
            try:
                result = await self.engine.embedding.embed([row.item for row in rows], self.params)
                assert result.embeddings is not None
                return list(result.embeddings), [None] * len(rows), result.prompt_tokens
            except InvalidInput as exc:
                if len(rows) == 1:
                    return [None], [str(exc)], 0
            # One bad row fails its call: find it, embed the rest one by one.
            outcomes = [await self._one(row) for row in rows]
            return [o[0] for o in outcomes], [o[1] for o in outcomes], sum(o[2] for o in outcomes)

    async def _one(self, row: Row) -> tuple[np.ndarray | None, str | None, int]:
        try:
            result = await self.engine.embedding.embed([row.item], self.params)
        except InvalidInput as exc:
            return None, str(exc), 0
        assert result.embeddings is not None
        return result.embeddings[0], None, result.prompt_tokens


def _length(item: str | ImageInput | None) -> int:
    return len(item) if isinstance(item, str) else 0


def _error(row: Row, message: str | None) -> dict:
    return {"row": row.index, "id": row.id, "error": message}
