"""Answering a gRPC request stream in order while its requests run at once, so that they batch on the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

Request = TypeVar("Request")
Response = TypeVar("Response")

# A stream's requests in the engine at once: enough to fill a batch, few enough that one stream cannot
# hold the whole in-flight limit.
STREAM_WINDOW = 16


async def answer_in_order(
    requests: AsyncIterable[Request], answer: Callable[[Request], Awaitable[Response]], window: int = STREAM_WINDOW
) -> AsyncIterator[Response]:
    """Yields `answer(request)` for each request, in arrival order; each starts as it arrives (up to `window`
    ahead of the one being answered). A failed answer ends the stream and cancels those still running."""
    started: asyncio.Queue = asyncio.Queue(maxsize=window)

    async def read_requests() -> None:
        try:
            async for request in requests:
                task = asyncio.ensure_future(answer(request))
                try:
                    await started.put(task)
                except BaseException:
                    task.cancel()  # never queued, so the answering side cannot cancel it
                    raise
        finally:
            await started.put(None)

    reader = asyncio.ensure_future(read_requests())
    try:
        while (task := await started.get()) is not None:
            yield await task
        await reader  # raises if reading the request stream failed
    finally:
        reader.cancel()
        while not started.empty():
            leftover = started.get_nowait()
            if leftover is not None:
                leftover.cancel()
