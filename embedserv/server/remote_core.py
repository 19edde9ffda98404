"""A front-end process's view of the engine host (`--frontends N`): the link, and one RemoteCore per model.

A front end parses, checks and tokenizes calls itself (its own tokenizer pool), then hands the input sequences
over the link; the engine host owns scheduling and the workers. RemoteCore implements the Core port
(engine/ports.py) over the link, so the Engine and its task services run in the front end unchanged.

Calls are matched to answers by call id. A caller that goes away (a cancelled RPC, a passed deadline, a
closed SSE stream) sends CancelCall, so the engine drops its queued sequences and frees a stream's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from embedserv.call_class import CALL_CLASS
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.tokenizer import TextTokenizer, TokenizerPool
from embedserv.engine.ports import CoreStatus, Inferred
from embedserv.errors import NotReady
from embedserv.logs import REQUEST_ID
from embedserv.server.link_messages import (
    CODEC,
    CallFailed,
    CancelCall,
    GenerateCall,
    GenerateEnd,
    Hello,
    InferCall,
    InferDone,
    error_of,
)
from embedserv.types import EmbedOutput, EngineRun, GenerationDelta, SamplingParams, TruncationDirection

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FrontendLink:
    """This front end's connection to the engine host: one zmq DEALER socket."""

    def __init__(self, address: str, index: int, handlers: dict[type, Callable[[Any], None]]) -> None:
        """`handlers`: what to do with each message the host sends that answers no call (Status, Drain,
        CancelAll), by its type."""
        self.index = index
        # Its own context, which close() ends: that is what waits for the last messages to leave.
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future | asyncio.Queue] = {}
        self._handlers = handlers
        self._receiver: asyncio.Task | None = None

    async def start(self, hello: Hello) -> None:
        self._receiver = asyncio.create_task(self._receive(), name="frontend-link")
        await self.send(hello)

    async def send(self, message: object) -> None:
        await self._socket.send_multipart(CODEC.encode(message), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long the last messages sent (Hello with an error, Drained) may take to go out; this
        waits for them (up to that long). A process's exit does not: zmq sends from a thread of its own, and a
        front end forked by the zygote ends with os._exit as soon as it returns (executor/zygote.py)."""
        if self._receiver is not None:
            self._receiver.cancel()
        for waiter in self._calls.values():
            if isinstance(waiter, asyncio.Future) and not waiter.done():
                waiter.set_exception(NotReady("the engine process went away; retry"))
            elif isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(CallFailed(0, "NotReady", "the engine process went away; retry"))
        self._socket.close(linger=linger_ms)
        self._context.term()

    async def _receive(self) -> None:
        while True:
            message = CODEC.decode(await self._socket.recv_multipart(copy=False))
            call_id = getattr(message, "call_id", None)
            if call_id is None:
                self._handlers[type(message)](message)
                continue
            waiter = self._calls.get(call_id)
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(message)
            elif waiter is not None and not waiter.done():
                waiter.set_result(message)

    async def infer(
        self,
        model: str,
        sequences: list[InputSequence],
        received: float,
        wanted: tuple[EmbedOutput, ...],
        use_cache: bool = True,
    ) -> InferDone:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            cls = CALL_CLASS.get()
            message = InferCall(
                call_id,
                model,
                sequences,
                received,
                tuple(wanted),
                REQUEST_ID.get(),
                use_cache,
                cls.priority,
                cls.tenant,
            )
            await self.send(message)
            reply = await future
        except asyncio.CancelledError:
            await self.send(CancelCall(call_id))
            raise
        finally:
            self._calls.pop(call_id, None)
        if isinstance(reply, CallFailed):
            raise error_of(reply)
        return reply

    async def generate(self, call: Callable[[int], GenerateCall]) -> AsyncIterator[GenerationDelta]:
        call_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[call_id] = queue
        finished = False
        try:
            await self.send(call(call_id))
            while True:
                message = await queue.get()
                if isinstance(message, CallFailed):
                    finished = True
                    raise error_of(message)
                if isinstance(message, GenerateEnd):
                    finished = True
                    return
                yield message.delta
        finally:
            self._calls.pop(call_id, None)
            if not finished:
                # The caller stopped reading (closed stream, cancelled call): the engine frees the stream.
                with contextlib.suppress(zmq.ZMQError):
                    await self.send(CancelCall(call_id))


class RemoteCore:
    """One model's Core over the link; its status is the engine host's last Status (at most a second old)."""

    def __init__(self, name: str, link: FrontendLink, tokenizer: TextTokenizer, tokenizer_threads: int = 1) -> None:
        self.name = name
        self.link = link
        self.tokenizer = tokenizer
        self._tokenizer_pool = TokenizerPool(tokenizer_threads, name)
        self._status = CoreStatus()

    def status(self) -> CoreStatus:
        return self._status

    def update(self, status: CoreStatus) -> None:
        self._status = status

    def stop(self) -> None:
        self._tokenizer_pool.shutdown()

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        return await self._tokenizer_pool.run(encode, args, chars)

    async def infer(
        self,
        sequences: list[InputSequence],
        received: float,
        wanted: tuple[EmbedOutput, ...] = (),
        use_cache: bool = True,
    ) -> Inferred:
        done = await self.link.infer(self.name, sequences, received, wanted, use_cache)
        tokenized = received + done.timing.tokenization_us / 1e6
        timing = replace(done.timing, runs=(EngineRun(received, tokenized, done.outputs),))
        return Inferred(done.outputs, done.tokens, timing)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        decoder_prompt: str = "",
        add_special_tokens: bool = True,
        stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        if not isinstance(prompt, str):
            # Checked here as the engine checks it: an id past int64 could not even cross the link.
            self.tokenizer.check_token_ids([prompt], False, TruncationDirection.RIGHT)

        def call(call_id: int) -> GenerateCall:
            request_id, cls = REQUEST_ID.get(), CALL_CLASS.get()
            return GenerateCall(
                call_id,
                self.name,
                prompt,
                params,
                decoder_prompt,
                add_special_tokens,
                request_id,
                cls.priority,
                cls.tenant,
                stream,
            )

        async with contextlib.aclosing(self.link.generate(call)) as deltas:
            async for delta in deltas:
                yield delta
