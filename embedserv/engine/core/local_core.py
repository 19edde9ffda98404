"""The engine core of one served model in this process: its workers, its prefill queue and generation streams,
and the dispatcher that gives the workers their steps. It implements the Core port (engine/ports.py).

Workers are processes (the server: `--data-parallel-size` of them, each with its own replica), or one model
thread in this process (LocalCore.load: library use and tests). The event loop stays free meanwhile, so new
calls are tokenized and queued while the devices work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from embedserv.config import ModelConfig
from embedserv.engine import checks
from embedserv.engine.core import workers as worker_builders
from embedserv.engine.core.dispatch import Dispatcher
from embedserv.engine.core.generation import GenerationStreams
from embedserv.engine.core.output_cache import CacheStats, OutputCache, cache_key
from embedserv.engine.core.prefill_work import PrefillWork
from embedserv.engine.core.prompts import prepare_prompt
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.tokenizer import TokenizerPool
from embedserv.engine.ports import CoreStatus, Inferred
from embedserv.engine.served_model import ServedModel, log_spec, read_served_model
from embedserv.errors import ConfigError, InvalidInput, NotReady
from embedserv.executor.base import Worker, WorkerStats
from embedserv.executor.process_worker import ProcessWorker
from embedserv.scheduler.prefill_only import CallCounts
from embedserv.steps import OutputKind
from embedserv.types import EmbedOutput, EngineRun, GenerationDelta, KvCacheUsage, SamplingParams, Task, Timing

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


@dataclass(frozen=True)
class ModelLoad:
    """One model's load at a scrape: API calls (not sequences) waiting for their first batch and running,
    tokens of the sequences waiting for a batch, and the workers' busy share of the last BUSY_WINDOW_S."""

    requests_waiting: int
    requests_running: int
    waiting_tokens: int
    worker_busy_ratio: float
    # Sequences (prefill) and streams (generation) waiting and running, per (priority, tenant).
    waiting_by_class: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    running_by_class: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class CoreStats:
    """What /metrics reads of a model in the engine host (at scrape time, from another thread)."""

    # Sequences queued for a first batch (prefill) or a first step (generation).
    num_waiting: int
    # Queued sequences and streams dropped without running because their call went away, since the start.
    num_dropped: int
    workers: list[WorkerStats]
    load: ModelLoad
    # The embedding cache's counters (None without one).
    cache: CacheStats | None
    kv_cache: KvCacheUsage | None


class LocalCore:
    def __init__(
        self,
        config: ModelConfig,
        served: ServedModel,
        workers: list[Worker],
        tokenizer_threads: int = 1,
        pipeline_depth: int = 1,
    ) -> None:
        self.served = served
        self.info, self.task, self.tokenizer = served.info, served.task, served.tokenizer
        self.workers = workers
        for worker in workers:
            worker.on_change = self._workers_changed
        name, budget, max_seqs = self.info.name, config.batch_token_budget, config.max_batch_requests
        self._tokenizer_pool = TokenizerPool(tokenizer_threads, name)
        wake = self._wake
        self.prefill: PrefillWork | None = None
        if served.task.tasks != (Task.GENERATE,):
            # Token classifiers' per-token logits are a POOL sequence's token vectors.
            per_token = served.spec.outputs.outputs or Task.TOKEN_CLASSIFY in served.task.tasks
            output = OutputKind.POOL if per_token else OutputKind.SCORE
            self.prefill = PrefillWork(
                name, workers, budget, max_seqs, output, wake, served.task, config.priority_policy
            )
        # Prefill outputs only: generation streams are not cached.
        self.cache: OutputCache | None = None
        if config.embedding_cache and self.prefill is not None:
            self.cache = OutputCache(config.embedding_cache)
        self.generation: list[GenerationStreams] = []
        if Task.GENERATE in served.task.tasks:
            self.generation = [
                GenerationStreams(
                    name,
                    worker,
                    self._tokenizer_pool,
                    served.eos_token_ids,
                    served.max_model_len,
                    budget,
                    max_seqs,
                    config.enable_prefix_caching,
                    wake,
                    config.priority_policy,
                )
                for worker in workers
            ]
            for streams in self.generation:
                # A worker past its memory ceiling is replaced once no stream is left on it.
                streams.worker.idle = streams.is_idle
        self.dispatcher = Dispatcher(name, workers, self.prefill, list(self.generation), pipeline_depth)
        # Prefill calls in flight, waiting or running (generation streams are counted by their schedulers).
        self._calls = CallCounts()
        self._started = False
        self._serving = False
        # Called on the event loop with is_serving whenever it flips (the engine host's health follows it).
        self.on_serving_change: Callable[[bool], None] = lambda serving: None

    @classmethod
    def load(cls, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> LocalCore:
        """The model in this process on one model thread (blocking; call it off the event loop)."""
        if config.data_parallel_size != 1:
            raise ConfigError("an in-process engine runs one replica; use worker processes for --data-parallel-size")
        served = read_served_model(config)
        log_spec(served, config)
        worker = worker_builders.load_local_worker(config, served.spec, warm_up)
        return cls(config, served, [worker], tokenizer_threads, config.pipeline_depth)

    @classmethod
    def with_worker_processes(
        cls, config: ModelConfig, tokenizer_threads: int = 1, workers: list[ProcessWorker] | None = None
    ) -> LocalCore:
        """`config.data_parallel_size` worker processes (`workers`, placed and perhaps launched already; else
        placed here), started (and waited for) by start(). Blocking: reads the model's config and tokenizer."""
        served = read_served_model(config)
        log_spec(served, config)
        workers = worker_builders.worker_processes(config) if workers is None else workers
        return cls(config, served, list(workers), tokenizer_threads, config.pipeline_depth)

    def _wake(self) -> None:
        self.dispatcher.wake()

    @property
    def is_running(self) -> bool:
        """Started, not stopped, and the dispatcher did not crash (workers may be restarting)."""
        return self._started and self.dispatcher.is_running

    @property
    def is_serving(self) -> bool:
        # A worker being replaced past its memory ceiling still serves: its calls wait for its successor.
        return self.is_running and any(worker.ready or worker.recycling for worker in self.workers)

    def status(self) -> CoreStatus:
        return CoreStatus(self.is_running, self.is_serving, self.kv_cache_usage())

    def stats(self) -> CoreStats:
        """Counters and snapshots only: safe to read from the metrics thread."""
        waiting = self.prefill.scheduler.num_waiting if self.prefill is not None else 0
        dropped = self.prefill.scheduler.num_dropped if self.prefill is not None else 0
        cache = dataclasses.replace(self.cache.stats) if self.cache is not None else None
        return CoreStats(
            waiting + sum(streams.num_waiting for streams in self.generation),
            dropped + sum(streams.num_dropped for streams in self.generation),
            [worker.stats() for worker in self.workers],
            self._load(),
            cache,
            self.kv_cache_usage(),
        )

    def _load(self) -> ModelLoad:
        """Calls waiting and running, waiting tokens and the workers' recent busy share."""
        waiting, running = self._calls.waiting, self._calls.running
        tokens = self.prefill.scheduler.waiting_tokens if self.prefill is not None else 0
        by_class: tuple[Counter, Counter] = (Counter(), Counter())
        if self.prefill is not None:
            by_class[0].update(self.prefill.scheduler.waiting_counts())
            by_class[1].update(self.prefill.running_counts())
        for streams in self.generation:
            scheduler = streams.scheduler
            if scheduler is not None:
                waiting += scheduler.num_waiting
                running += scheduler.num_running
                tokens += scheduler.waiting_tokens
                by_class[0].update(scheduler.waiting_counts())
                by_class[1].update(scheduler.running_counts())
        return ModelLoad(waiting, running, tokens, self.dispatcher.busy_ratio(), *map(dict, by_class))

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
            self._tokenizer_pool.shutdown()
            raise failed
        self._started = True
        self.dispatcher.start()
        for streams in self.generation:
            streams.start()
        if self.prefill is not None:
            self.prefill.accepting = True
        self._workers_changed()

    def _workers_changed(self) -> None:
        if self.prefill is not None:
            self.prefill.workers_changed()
        for streams in self.generation:
            streams.workers_changed()
        self.dispatcher.wake()
        serving = self.is_serving
        if serving != self._serving and self._started:
            self._serving = serving
            logger.log(
                logging.INFO if serving else logging.ERROR,
                "%s: %s",
                self.info.name,
                "serving" if serving else "no worker is running; NOT_SERVING until one is back",
            )
            self.on_serving_change(serving)

    async def stop(self) -> None:
        self._started = False
        await self.dispatcher.stop()
        for streams in self.generation:
            streams.stop()
        if self.prefill is not None:
            self.prefill.fail_all(NotReady(f"model {self.info.name} is shutting down; retry on another replica"))
        await asyncio.gather(*(worker.stop() for worker in self.workers))
        self._tokenizer_pool.shutdown()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        decoder_prompt: str = "",
        add_special_tokens: bool = True,
        stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """The tokenized request goes to the ready worker with the fewest streams and stays there (its KV)."""
        checks.require(self.info, Task.GENERATE, "Generate")
        if decoder_prompt and not self.info.is_encoder_decoder:
            raise InvalidInput(
                f"decoder_prompt is only for encoder-decoder models; model {self.info.name!r} is decoder-only "
                "(put the whole text in prompt)"
            )
        prepared = await prepare_prompt(
            self.tokenizer,
            self._tokenizer_pool,
            prompt,
            params,
            decoder_prompt=decoder_prompt,
            decoder_start_token_id=self.task.decoder_start_token_id,
            add_special_tokens=add_special_tokens,
        )
        ready = [streams for streams in self.generation if streams.is_accepting]
        if not ready:
            raise NotReady(f"no worker of model {self.info.name} is running (restarting); retry shortly")
        chosen = min(ready, key=lambda streams: streams.num_streams)
        # Closed at once when the caller stops early, so the stream's KV blocks go back now, not at GC.
        async with aclosing(chosen.stream(prepared, params, whole=not stream)) as deltas:
            async for delta in deltas:
                yield delta

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        return await self._tokenizer_pool.run(encode, args, chars)

    async def infer(
        self,
        sequences: list[InputSequence],
        received: float,
        wanted: tuple[EmbedOutput, ...] = (),
        use_cache: bool = True,
    ) -> Inferred:
        """Runs every sequence through the scheduler, or the embedding cache first unless `use_cache` is off."""
        tokenized = time.perf_counter()
        stripped = sequences
        if self.task.strip_trailing_pad_id is not None:
            stripped = [self._stripped(sequence) for sequence in sequences]
        prefill = self.prefill
        if prefill is None:
            raise InvalidInput(
                f"model {self.info.name} only generates text; it takes no embed, rerank or classify call"
            )
        requests = [prefill.new_request(sequence, wanted) for sequence in stripped]
        call = self._calls.admit()
        for request in requests:
            request.call = call
        try:
            if self.cache is not None and use_cache:
                keys = [cache_key(sequence, wanted) for sequence in stripped]
                outputs, ran = await self.cache.run(requests, keys, prefill.run)
            else:
                outputs = ran = await prefill.run(requests)
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
            runs=(EngineRun(received, tokenized, ran),),
        )
        # Usage counts the input's tokens, cached or not: an encoder-decoder request's encoder input (its
        # decoder reads the start token or the same input shifted).
        tokens = sum(len(r.encoder_token_ids) or len(r.prompt_token_ids) for r in requests)
        return Inferred(outputs, tokens, timing)

    def _stripped(self, sequence: InputSequence) -> InputSequence:
        """Without the trailing pad ids of models whose tokenizer pads (what the workers run, and the cache key)."""
        pad = self.task.strip_trailing_pad_id
        ids, types = sequence.ids, sequence.token_type_ids
        end = len(ids)
        while end > 1 and ids[end - 1] == pad:
            end -= 1
        if end == len(ids):
            return sequence
        return dataclasses.replace(sequence, ids=ids[:end], token_type_ids=types[:end] if types is not None else None)
