"""The engine core of one served model: its workers, one step loop per worker, the step sources those
loops take work from, and the two ways in: `infer` (prefill-only sequences) and `generate` (streams).

Each worker's loop (step_loop.py) takes that worker's generation steps first (its streams live in its
KV cache), then batches from the model's shared prefill queue. Workers are processes (the server:
`--data-parallel-size` of them, each with its own replica), or one model thread in this process
(Engine.load: library use and tests). The event loop stays free meanwhile, so new calls are tokenized
and queued while the devices work. The task services reach this class only through engine/ports.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, TypeVar

from embedserv import tracing
from embedserv.config import ModelConfig
from embedserv.engine import checks
from embedserv.engine.core.generation import GenerationStreams, prepare_prompt
from embedserv.engine.core.output_cache import CacheStats, OutputCache, cache_key
from embedserv.engine.core.prefill import PrefillQueue
from embedserv.engine.core.step_loop import WorkerLoop
from embedserv.engine.core.step_source import StepSource
from embedserv.engine.served_model import ServedModel
from embedserv.engine.ports import SequenceOutput, run_tokenizer
from embedserv.engine.inputs.tokenizer import Encoded
from embedserv.errors import InvalidInput, NotReady
from embedserv.executor.base import Worker, WorkerStats
from embedserv.scheduler.load import CallCounts, ModelLoad
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind
from embedserv.types import EmbedOutput, GenerationDelta, KvCacheUsage, SamplingParams, Task, Timing

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


class EngineCore:
    """Implements the task services' port (engine/ports.py, Infer)."""

    def __init__(
        self, config: ModelConfig, served: ServedModel, workers: list[Worker], tokenizer_threads: int = 1,
        pipeline_depth: int = 1,
    ) -> None:
        self.info, self.task, self.tokenizer = served.info, served.task, served.tokenizer
        self.workers = workers
        for worker in workers:
            worker.on_change = self._workers_changed
        name, budget, max_seqs = self.info.name, config.batch_token_budget, config.max_batch_requests
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix=f"tokenize-{name}")
        self.prefill: PrefillQueue | None = None
        if served.task.tasks != (Task.GENERATE,):
            output = OutputKind.POOL if served.spec.outputs.outputs else OutputKind.SCORE
            self.prefill = PrefillQueue(name, workers, budget, max_seqs, output)
        # Prefill outputs only: generation streams are not cached.
        self.cache: OutputCache | None = None
        if config.embedding_cache and self.prefill is not None:
            self.cache = OutputCache(config.embedding_cache)
        self.generation: list[GenerationStreams] = []
        if Task.GENERATE in served.task.tasks:
            self.generation = [
                GenerationStreams(
                    name, worker, self._tokenizer_pool, served.eos_token_ids, served.max_model_len, budget, max_seqs,
                    config.enable_prefix_caching,
                )
                for worker in workers
            ]
        self._loops = [
            WorkerLoop(name, worker, self._sources_of(index), pipeline_depth) for index, worker in enumerate(workers)
        ]
        # Prefill calls in flight, waiting or running (generation streams are counted by their schedulers).
        self._calls = CallCounts()
        self._started = False
        self._serving = False
        self._serving_listeners: list[Callable[[bool], None]] = []

    def _sources_of(self, index: int) -> list[StepSource]:
        """Worker `index`'s step sources by priority: its own generation streams, then the shared prefill queue."""
        sources: list[StepSource] = [self.generation[index]] if self.generation else []
        return sources + ([self.prefill] if self.prefill is not None else [])

    @property
    def is_running(self) -> bool:
        """Started, not stopped, and no loop crashed (workers may be restarting)."""
        return self._started and all(loop.is_running for loop in self._loops)

    @property
    def is_serving(self) -> bool:
        """Running with at least one worker ready: what health reports for this model."""
        return self.is_running and any(worker.ready for worker in self.workers)

    def add_serving_listener(self, listener: Callable[[bool], None]) -> None:
        """`listener(is_serving)` is called on the event loop whenever is_serving flips."""
        self._serving_listeners.append(listener)

    def worker_stats(self) -> list[WorkerStats]:
        return [worker.stats() for worker in self.workers]

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a first batch (prefill) or a first step (generation)."""
        waiting = self.prefill.num_waiting if self.prefill is not None else 0
        return waiting + sum(streams.num_waiting for streams in self.generation)

    @property
    def num_dropped(self) -> int:
        """Queued sequences (prefill) and streams (generation) dropped without running because their call
        went away, since the start."""
        dropped = self.prefill.num_dropped if self.prefill is not None else 0
        return dropped + sum(streams.num_dropped for streams in self.generation)

    def current_load(self) -> ModelLoad:
        """Calls waiting and running, waiting tokens and the workers' recent busy share (read at scrape time,
        from another thread: only counters and snapshots)."""
        waiting, running = self._calls.waiting, self._calls.running
        tokens = self.prefill.scheduler.waiting_tokens if self.prefill is not None else 0
        for streams in self.generation:
            scheduler = streams.scheduler
            if scheduler is not None:
                waiting += scheduler.num_waiting
                running += scheduler.num_running
                tokens += scheduler.waiting_tokens
        busy = sum(loop.busy.ratio() for loop in self._loops) / len(self._loops) if self._loops else 0.0
        return ModelLoad(waiting, running, tokens, busy)

    async def start(self) -> None:
        """Starts every worker and waits until all are ready; if one cannot start, stops the rest and raises."""
        starts = [asyncio.create_task(worker.start()) for worker in self.workers]
        try:
            done, pending = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            # The server is stopping while this model loads: stop() then ends the processes.
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            raise
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await asyncio.gather(*(worker.stop() for worker in self.workers), return_exceptions=True)
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            raise failed
        self._started = True
        for loop in self._loops:
            loop.start()
        if self.prefill is not None:
            self.prefill.accepting = True
        self._workers_changed()

    def _workers_changed(self) -> None:
        if self.prefill is not None:
            self.prefill.workers_changed()
        for streams in self.generation:
            streams.workers_changed()
        for loop in self._loops:
            loop.wake()
        serving = self.is_serving
        if serving != self._serving and self._started:
            self._serving = serving
            logger.log(
                logging.INFO if serving else logging.ERROR, "%s: %s", self.info.name,
                "serving" if serving else "no worker is running; NOT_SERVING until one is back",
            )
            for listener in self._serving_listeners:
                listener(serving)

    async def stop(self) -> None:
        self._started = False
        for loop in self._loops:
            await loop.stop()
        if self.prefill is not None:
            self.prefill.fail_all(NotReady(f"model {self.info.name} is shutting down; retry on another replica"))
        await asyncio.gather(*(worker.stop() for worker in self.workers))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, decoder_prompt: str = "",
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """Engine.generate: the tokenized request goes to the ready worker with the fewest streams and stays
        there (its KV)."""
        checks.require(self.info, Task.GENERATE, "Generate")
        if decoder_prompt and not self.info.is_encoder_decoder:
            raise InvalidInput(
                f"decoder_prompt is only for encoder-decoder models; model {self.info.name!r} is decoder-only "
                "(put the whole text in prompt)"
            )
        prepared = await prepare_prompt(
            self.tokenizer, self._tokenizer_pool, prompt, params, decoder_prompt=decoder_prompt,
            decoder_start_token_id=self.task.decoder_start_token_id, add_special_tokens=add_special_tokens,
        )
        ready = [streams for streams in self.generation if streams.is_accepting]
        if not ready:
            raise NotReady(f"no worker of model {self.info.name} is running (restarting); retry shortly")
        chosen = min(ready, key=lambda streams: streams.num_streams)
        # Closed at once when the caller stops early, so the stream's KV blocks go back now, not at GC.
        async with aclosing(chosen.stream(prepared, params)) as deltas:
            async for delta in deltas:
                yield delta

    def kv_cache_usage(self) -> KvCacheUsage | None:
        """Blocks in use now, summed over the workers (None for models that do not generate)."""
        if not self.generation:
            return None
        usages = [streams.kv_cache_usage() for streams in self.generation]
        return KvCacheUsage(
            block_size=max(u.block_size for u in usages),
            total_blocks=sum(u.total_blocks for u in usages),
            used_blocks=sum(u.used_blocks for u in usages),
            preemptions=sum(u.preemptions for u in usages),
            cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages),
        )

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        """Runs a tokenizer method in the tokenizer pool, or here for short inputs (ports.run_tokenizer)."""
        return await run_tokenizer(self._tokenizer_pool, encode, args, chars)

    async def infer(
        self, encoded: list[Encoded], received: float, wanted: tuple[EmbedOutput, ...] = (), use_cache: bool = True
    ) -> tuple[list[SequenceOutput], int, Timing]:
        """Runs every sequence through the scheduler, or the embedding cache first unless `use_cache` is off;
        outputs in input order, tokens run, and the call's timing."""
        tokenized = time.perf_counter()
        stripped = [self._stripped(e) for e in encoded]
        requests = [self._request(e, wanted) for e in stripped]
        call = self._calls.admit()
        for request in requests:
            request.call = call
        try:
            if self.cache is not None and use_cache:
                keys = [cache_key(e, wanted) for e in stripped]
                outputs, ran = await self.cache.run(requests, keys, self.prefill.run)
            else:
                outputs = ran = await self.prefill.run(requests)
        finally:
            call.done()
        # Only the sequences that ran for this call took queue and inference time: a call answered from the
        # cache took none. An identical sequence it waited for may have started before it came.
        first_start = max(tokenized, min((output.started for output in ran), default=tokenized))
        last_end = max((output.finished for output in ran), default=first_start)
        timing = Timing(
            queue_us=_us(first_start - tokenized),
            tokenization_us=_us(tokenized - received),
            inference_us=_us(last_end - first_start),
            total_us=_us(time.perf_counter() - received),
        )
        # Usage counts the input's tokens, cached or not: an encoder-decoder request's encoder input (its
        # decoder reads the start token or the same input shifted).
        tokens = sum(r.num_encoder_tokens or r.num_tokens for r in requests)
        tracing.engine_ran(received, timing, ran)
        return outputs, tokens, timing

    def cache_stats(self) -> CacheStats | None:
        """The embedding cache's counters, or None when the model has none (--embedding-cache 0)."""
        return dataclasses.replace(self.cache.stats) if self.cache is not None else None

    def _stripped(self, encoded: Encoded) -> Encoded:
        """Without the trailing pad ids of models whose tokenizer pads (what the workers run, and the cache key)."""
        pad = self.task.strip_trailing_pad_id
        if pad is None:
            return encoded
        ids, types = encoded.ids, encoded.token_type_ids
        end = len(ids)
        while end > 1 and ids[end - 1] == pad:
            end -= 1
        if end == len(ids):
            return encoded
        return dataclasses.replace(encoded, ids=ids[:end], token_type_ids=types[:end] if types is not None else None)

    def _request(self, encoded: Encoded, wanted: tuple[EmbedOutput, ...] = ()) -> Request:
        ids, types = encoded.ids, encoded.token_type_ids
        start = self.task.decoder_start_token_id
        if start is not None:
            # Encoder-decoder: the text is the encoder's input; the decoder reads its start token (a yes/no
            # reranker's first step) or the input shifted right behind it (BART's classifier).
            decoder = [start] if self.task.prefill_decoder_input == "start" else [start] + ids[:-1]
            return self.prefill.new_request(decoder, encoder_token_ids=ids)
        return self.prefill.new_request(
            ids, pool_start=encoded.pool_start, token_type_ids=types, outputs=wanted, adapter=encoded.adapter,
            pixels=encoded.pixels, image_grid=encoded.image_grid,
        )
