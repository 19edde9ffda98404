"""Drive embedserv_client.Client and AsyncClient through one blocking interface, so a test runs both.

`driver("sync" | "async", target, **client_kwargs).embed(...)` returns what Client.embed returns. The async
driver runs each call in its own event loop with its own AsyncClient (an AsyncClient belongs to the loop
that made it). Streams come back collected: generate as a Generated, embed_stream as a list."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from embedserv_client import AsyncClient, Client, Usage


@dataclass
class Generated:
    pieces: list[str]
    finish_reason: str | None
    usage: Usage | None
    token_ids: list[int]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class SyncDriver:
    def __init__(self, target: str, **client_kwargs) -> None:
        self.client = Client(target, **client_kwargs)

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            if name == "generate":
                pieces = list(result)
                return Generated(pieces, result.finish_reason, result.usage, result.token_ids)
            if name == "embed_stream":
                return list(result)
            return result

        return call

    def close(self) -> None:
        self.client.close()


class AsyncDriver:
    def __init__(self, target: str, **client_kwargs) -> None:
        self.target = target
        self.client_kwargs = client_kwargs

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            return asyncio.run(self._call(name, args, kwargs))

        return call

    async def _call(self, name: str, args, kwargs):
        async with AsyncClient(self.target, **self.client_kwargs) as client:
            result = getattr(client, name)(*args, **kwargs)
            if name == "generate":
                pieces = [piece async for piece in result]
                return Generated(pieces, result.finish_reason, result.usage, result.token_ids)
            if name == "embed_stream":
                return [matrix async for matrix in result]
            return await result

    def close(self) -> None:
        pass


def driver(kind: str, target: str, **client_kwargs) -> SyncDriver | AsyncDriver:
    return SyncDriver(target, **client_kwargs) if kind == "sync" else AsyncDriver(target, **client_kwargs)
