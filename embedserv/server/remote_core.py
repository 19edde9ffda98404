"""A front-end process's view of the engine process (`--frontends N`): the link, and one RemoteCore per model.

A front end parses, checks and tokenizes calls itself (its own tokenizer pool), then hands the encoded
sequences over the link; the engine process owns scheduling and the workers. RemoteCore stands where an
Engine's EngineCore stands in a one-process server, so the Engine facade and its task services run in the
front end unchanged: the link is the task services' port (engine/ports.py, Infer).

Calls are matched to answers by call id. A caller that goes away (a cancelled RPC, a passed deadline, a
closed SSE stream) sends CancelCall, so the engine drops its queued sequences and frees a stream's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

import zmq
import zmq.asyncio

from embedserv import tracing
from embedserv.engine.ports import SequenceOutput, run_tokenizer
from embedserv.engine.inputs.tokenizer import Encoded, TextTokenizer
from embedserv.errors import NotReady
from embedserv.executor.base import WorkerStats
from embedserv.logs import REQUEST_ID
from embedserv.server import link_messages as m
from embedserv.types import EmbedOutput, GenerationDelta, KvCacheUsage, SamplingParams, Timing, TruncationDirection

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FrontendLink:
    """This front end's connection to the engine process: one zmq DEALER socket."""

    def __init__(self, address: str, index: int, on_message: Callable[[object], None]) -> None:
        self.index = index
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future | asyncio.Queue] = {}
        # Status, Drain and CancelAll go to the front end's server.
        self._on_message = on_message
        self._receiver: asyncio.Task | None = None

    async def start(self, hello: m.Hello) -> None:
        self._receiver = asyncio.create_task(self._receive(), name="frontend-link")
        await self.send(hello)

    async def send(self, message: object) -> None:
        await self._socket.send_multipart(m.CODEC.encode(message), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long the last messages sent (Hello with an error, Drained) may take to go out."""
        if self._receiver is not None:
            self._receiver.cancel()
        for waiter in self._calls.values():
            if isinstance(waiter, asyncio.Future) and not waiter.done():
                waiter.set_exception(NotReady("the engine process went away; retry"))
            elif isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(m.CallFailed(0, "NotReady", "the engine process went away; retry"))
        self._socket.close(linger=linger_ms)

    async def _receive(self) -> None:
        while True:
            message = m.CODEC.decode(await self._socket.recv_multipart(copy=False))
            call_id = getattr(message, "call_id", None)
            if call_id is None:
                self._on_message(message)
                continue
            waiter = self._calls.get(call_id)
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(message)
            elif waiter is not None and not waiter.done():
                waiter.set_result(message)

    async def infer(
        self, model: str, encoded: list[Encoded], received: float, wanted, use_cache: bool = True
    ) -> m.InferDone:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self.send(
                m.InferCall(call_id, model, encoded, received, tuple(wanted), REQUEST_ID.get(), use_cache)
            )
            reply = await future
        except asyncio.CancelledError:
            await self.send(m.CancelCall(call_id))
            raise
        finally:
            self._calls.pop(call_id, None)
        if isinstance(reply, m.CallFailed):
            raise m.error_of(reply)
        return reply

    async def generate(self, call: Callable[[int], m.GenerateCall]) -> AsyncIterator[GenerationDelta]:
        call_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._calls[call_id] = queue
        finished = False
        try:
            await self.send(call(call_id))
            while True:
                message = await queue.get()
                if isinstance(message, m.CallFailed):
                    finished = True
                    raise m.error_of(message)
                if isinstance(message, m.GenerateEnd):
                    finished = True
                    return
                yield message.delta
        finally:
            self._calls.pop(call_id, None)
            if not finished:
                # The caller stopped reading (closed stream, cancelled call): the engine frees the stream.
                with contextlib.suppress(zmq.ZMQError):
                    await self.send(m.CancelCall(call_id))


class RemoteCore:
    """The engine core of one model as a front end sees it: same surface as EngineCore, over the link."""

    def __init__(self, name: str, link: FrontendLink, tokenizer: TextTokenizer, tokenizer_threads: int = 1) -> None:
        self.name = name
        self.link = link
        self.tokenizer = tokenizer
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix=f"tokenize-{name}")
        self.status = m.ModelStatus(name, running=False, serving=False)
        # The engine process's /metrics reports queues and workers; a front end has none of its own.
        self.workers: list = []
        self.num_waiting = 0
        self.num_dropped = 0
        self._serving_listeners: list[Callable[[bool], None]] = []

    def update(self, status: m.ModelStatus) -> None:
        was = self.status.serving
        self.status = status
        if status.serving != was:
            for listener in self._serving_listeners:
                listener(status.serving)

    @property
    def is_running(self) -> bool:
        return self.status.running

    @property
    def is_serving(self) -> bool:
        return self.status.serving

    def add_serving_listener(self, listener: Callable[[bool], None]) -> None:
        self._serving_listeners.append(listener)

    def worker_stats(self) -> list[WorkerStats]:
        return []

    def current_load(self) -> None:
        """The engine process's /metrics reports the model's load."""
        return None

    def kv_cache_usage(self) -> KvCacheUsage | None:
        """As of the engine's last Status (at most a second old)."""
        return self.status.kv_cache

    def cache_stats(self) -> None:
        """The embedding cache is the engine process's; its /metrics reports it."""
        return None

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        return await run_tokenizer(self._tokenizer_pool, encode, args, chars)

    async def infer(
        self, encoded: list[Encoded], received: float, wanted: tuple[EmbedOutput, ...] = (), use_cache: bool = True
    ) -> tuple[list[SequenceOutput], int, Timing]:
        done = await self.link.infer(self.name, encoded, received, wanted, use_cache)
        tracing.engine_ran(received, done.timing, done.outputs)
        return done.outputs, done.tokens, done.timing

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, decoder_prompt: str = "", add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        if not isinstance(prompt, str):
            # Checked here as the engine checks it: an id past int64 could not even cross the link.
            self.tokenizer.check_token_ids([prompt], False, TruncationDirection.RIGHT)

        def call(call_id: int) -> m.GenerateCall:
            return m.GenerateCall(
                call_id, self.name, prompt, params, decoder_prompt, add_special_tokens, REQUEST_ID.get()
            )

        async with contextlib.aclosing(self.link.generate(call)) as deltas:
            async for delta in deltas:
                yield delta
