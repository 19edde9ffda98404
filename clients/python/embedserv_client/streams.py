"""Generate's text streams, sync and async: iterate for the text; the finish reason and usage arrive last.

A stream is retried only if it fails before its first message: after that, part of the text has been
handed to the caller and a retry could not take it back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import numpy as np

from embedserv_client import plans
from embedserv_client.options import RetryPolicy, time_left
from embedserv_client.types import FINISH_REASONS, EmbedservError, Usage, error_from
from embedserv_client.v1 import embedserv_pb2 as pb


class _Generation:
    """What a stream has told so far, and how to (re)start and cancel it."""

    def __init__(self, start: Callable[[float | None], object], retry: RetryPolicy, deadline: float | None):
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._start = start  # timeout -> a new Generate call
        self._retry = retry
        self._deadline = deadline
        self._call: Any = None  # the running grpc call (its stub types are not annotated)
        self._cancelled = False

    def cancel(self) -> None:
        """Stop generating; the server frees the sequence's KV cache at once."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _retry_delay(self, err: grpc.RpcError, received: bool, attempt: int) -> float:
        """Seconds to wait before starting over, or raise: never once text went out, nor after cancel()."""
        delay = None if received or self._cancelled else self._retry.delay(err.code(), attempt, self._deadline)
        if delay is None:
            raise error_from(err) from None
        return delay

    def take(self, reply: pb.GenerateResponse) -> str:
        self.token_ids.extend(reply.token_ids)
        if reply.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(reply.finish_reason, "unspecified")
            self.usage = Usage(reply.usage.prompt_tokens, reply.usage.completion_tokens)
        return reply.text


class TextStream(_Generation):
    """`for text in client.generate(...)`; then `.finish_reason` ("length", "stop", "eos" or
    "cancelled"), `.usage` and `.token_ids`. `.text()` reads the rest and returns it whole."""

    def __iter__(self) -> Iterator[str]:
        attempt = 0
        while True:
            attempt += 1
            self._call = self._start(time_left(self._deadline))
            received = False
            try:
                for reply in self._call:
                    received = True
                    yield self.take(reply)
                return
            except grpc.RpcError as err:
                delay = self._retry_delay(err, received, attempt)
            time.sleep(delay)

    def text(self) -> str:
        return "".join(self)

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncTextStream(_Generation):
    """`async for text in client.generate(...)`; otherwise as TextStream (`await stream.text()`)."""

    async def __aiter__(self) -> AsyncIterator[str]:
        attempt = 0
        while True:
            attempt += 1
            self._call = self._start(time_left(self._deadline))
            received = False
            try:
                async for reply in self._call:
                    received = True
                    yield self.take(reply)
                return
            except grpc.RpcError as err:
                delay = self._retry_delay(err, received, attempt)
            except asyncio.CancelledError:
                if self._cancelled:
                    raise EmbedservError(grpc.StatusCode.CANCELLED, "the stream was cancelled") from None
                raise
            await asyncio.sleep(delay)

    async def text(self) -> str:
        return "".join([piece async for piece in self])

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


def stream_matrices(replies, checked: plans.StreamRequests) -> Iterator[np.ndarray]:
    """EmbedStream's matrices, one per reply, from a blocking call (cancelled when the caller stops reading)."""
    try:
        for reply in replies:
            yield plans.embedding_matrix([reply], checked.fields["encoding"])
    except grpc.RpcError as err:
        if checked.error is not None:
            raise checked.error from None
        raise error_from(err) from None
    finally:
        replies.cancel()
