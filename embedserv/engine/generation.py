"""The generation side of an Engine: continuous batching over the paged KV cache, streamed text.

`generate()` checks the request, tokenizes the prompt and queues it with the GenerationScheduler; one
loop task runs step after step on the model thread (shared with the model's prefill-only work), then
turns the sampled tokens into text deltas in the tokenizer pool and decides who is done (max_tokens, a
stop string, EOS). A stream that ends for any reason, the client's cancel or deadline included,
returns its KV blocks before the next step is scheduled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from embedserv.engine.detokenizer import IncrementalDetokenizer
from embedserv.engine.loading import GenerationParts
from embedserv.engine.tokenizer import TextTokenizer
from embedserv.engine.types import GenerationDelta, KvCacheUsage, SamplingParams
from embedserv.errors import InvalidInput, NotReady
from embedserv.scheduler.block_manager import BlockManager
from embedserv.scheduler.generation import GenerationBatch, GenerationRequest, GenerationScheduler

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    request: GenerationRequest
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


def check_sampling(params: SamplingParams) -> None:
    if params.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be at least 1, not {params.max_tokens}")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise InvalidInput(f"temperature must be 0 (greedy) or above, not {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], not {params.top_p}")
    if params.top_k < 0:
        raise InvalidInput(f"top_k must be 0 (no cut) or above, not {params.top_k}")
    if any(not s for s in params.stop):
        raise InvalidInput("stop strings must not be empty")


class GenerationLoop:
    def __init__(
        self,
        name: str,
        parts: GenerationParts,
        tokenizer: TextTokenizer,
        model_thread: ThreadPoolExecutor,
        tokenizer_pool: ThreadPoolExecutor,
        max_batch_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool,
    ) -> None:
        self.name = name
        self.parts = parts
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(parts.num_blocks, parts.block_size, enable_prefix_caching)
        self.scheduler = GenerationScheduler(self.block_manager, max_batch_tokens, max_num_seqs)
        self._model_thread = model_thread
        self._tokenizer_pool = tokenizer_pool
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def kv_cache_usage(self) -> KvCacheUsage:
        return KvCacheUsage(
            block_size=self.block_manager.block_size,
            total_blocks=self.block_manager.num_blocks,
            used_blocks=self.block_manager.num_used_blocks,
            preemptions=self.scheduler.num_preemptions,
            cached_prompt_tokens=self.scheduler.num_cached_tokens,
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"generate-{self.name}")
        self._task.add_done_callback(self._on_exit)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._end_all("cancelled")

    def _on_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.error("generation loop of %s died", self.name, exc_info=task.exception())
        for stream in list(self._streams.values()):
            self._close(stream, NotReady(f"model {self.name} stopped after an internal error; retry later"))

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[GenerationDelta]:
        if not prompt:
            raise InvalidInput("prompt is empty; send the text to continue")
        check_sampling(params)
        loop = asyncio.get_running_loop()
        token_ids, detokenizer = await loop.run_in_executor(self._tokenizer_pool, self._prepare, prompt, params)
        self._check_fits(len(token_ids), params.max_tokens)
        if not self.is_running:
            raise NotReady(f"model {self.name} is not running; retry shortly")
        request = GenerationRequest(next(self._ids), token_ids, params.max_tokens)
        stream = _Stream(request, params, detokenizer)
        self._streams[request.request_id] = stream
        self.scheduler.add(request)
        self._wakeup.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Also when the caller stops listening (client cancel, deadline): the blocks go back now.
            self._forget(stream)

    def _prepare(self, prompt: str, params: SamplingParams) -> tuple[list[int], IncrementalDetokenizer]:
        """The prompt's ids and the request's detokenizer (tokenizer thread: both decode the prompt)."""
        token_ids = self.tokenizer.encode_prompt(prompt)
        if not token_ids:
            raise InvalidInput("the prompt has no tokens for this model's tokenizer; send some text")
        return token_ids, IncrementalDetokenizer(self.tokenizer.hf_tokenizer, token_ids, params.stop)

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        total = prompt_tokens + max_tokens
        limit = self.parts.max_model_len
        if total > limit:
            raise InvalidInput(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} make {total}, more than the "
                f"model's context of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        if not self.scheduler.can_ever_fit(total):
            capacity = self.block_manager.num_blocks * self.block_manager.block_size
            raise InvalidInput(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} need more than this server's "
                f"KV cache of {capacity} tokens; lower max_tokens or shorten the prompt"
            )

    def _forget(self, stream: _Stream) -> None:
        self._streams.pop(stream.request.request_id, None)
        self.scheduler.finish(stream.request.request_id)
        stream.finished = True

    def _close(self, stream: _Stream, item) -> None:
        if not stream.finished:
            stream.queue.put_nowait(item)
        self._forget(stream)

    def _end_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            request = stream.request
            self._close(stream, GenerationDelta(
                "", (), reason, len(request.prompt_token_ids), len(request.output_token_ids)
            ))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self.scheduler.schedule()
            if batch is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            sampling = {c.request_id: self._streams[c.request_id].params for c in batch.chunks if c.samples}
            try:
                sampled = await loop.run_in_executor(
                    self._model_thread, self.parts.runner.execute, batch, sampling
                )
            except Exception as exc:
                logger.exception("generation step of %d sequences failed on %s", batch.num_sequences, self.name)
                self._fail(batch, exc)
                continue
            self.scheduler.update(batch, sampled)
            live = {rid: token for rid, token in sampled.items() if rid in self._streams}
            deltas = await loop.run_in_executor(self._tokenizer_pool, self._detokenize, live)
            for request_id, delta in deltas:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if delta.finish_reason is not None:
                    self._close(stream, delta)
                else:
                    stream.queue.put_nowait(delta)

    def _fail(self, batch: GenerationBatch, exc: Exception) -> None:
        for chunk in batch.chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                self._close(stream, RuntimeError(f"generation failed: {exc}"))

    def _detokenize(self, sampled: dict[int, int]) -> list[tuple[int, GenerationDelta]]:
        """New text and the finish decision of every request that got a token (tokenizer thread)."""
        out = []
        for request_id, token in sampled.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            out.append((request_id, self._next_delta(stream, token)))
        return out

    def _next_delta(self, stream: _Stream, token: int) -> GenerationDelta:
        request, params, detokenizer = stream.request, stream.params, stream.detokenizer
        is_eos = token in self.parts.eos_token_ids and not params.ignore_eos
        text = "" if is_eos else detokenizer.add(token)
        if detokenizer.stopped:
            reason = "stop"
        elif is_eos:
            reason = "eos"
        elif len(request.output_token_ids) >= params.max_tokens:
            reason = "length"
        else:
            return GenerationDelta(text, (token,))
        if reason != "stop":
            text += detokenizer.flush()
        return GenerationDelta(text, (token,), reason, len(request.prompt_token_ids), len(request.output_token_ids))
