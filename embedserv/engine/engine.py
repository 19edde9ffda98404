"""The asyncio engine of one served model.

Calls tokenize in a thread pool, split into one scheduler request per input, and wait on futures. Each
worker has one step loop (step_loop.py) that takes batches from the model's shared prefill queue and,
when the model generates, steps from that worker's own generation streams (its KV cache). Workers are
processes (the server: `--data-parallel-size` of them, each with its own replica), or one model thread in
this process (Engine.load: library use and tests). The event loop stays free meanwhile, so new calls are
tokenized and queued while the devices work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator, Callable

import torch

from embedserv.config import ModelConfig
from embedserv.engine import checks, chunking, embedding, multi_vector, quantize, reranking, zero_shot
from embedserv.engine.generation import GenerationStreams, prepare_prompt
from embedserv.engine.loading import ServedModel, log_spec, read_served_model
from embedserv.engine.outputs import activate
from embedserv.engine.prefill import PrefillQueue, SequenceOutput, stack_rows
from embedserv.engine.step_loop import WorkerLoop
from embedserv.engine.tokenizer import Encoded
from embedserv.errors import ConfigError, InvalidInput, NotReady
from embedserv.executor.base import Worker, WorkerStats
from embedserv.executor.local_worker import LocalWorker
from embedserv.executor.placement import available_cores, place_workers
from embedserv.executor.process_worker import ProcessWorker
from embedserv.scheduler.request import Request
from embedserv.types import (
    Activation, ClassifyParams, ClassifyResult, EmbedOutput, EmbedParams, EmbedResult, Encoding, GenerationDelta,
    KvCacheUsage, ModelInfo, OutputKind, RerankMode, RerankParams, RerankResult, SamplingParams, Task, Timing,
    TokenizedText,
)
from embedserv.worker.replica import build_runner

logger = logging.getLogger(__name__)


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


class Engine:
    def __init__(
        self, config: ModelConfig, served: ServedModel, workers: list[Worker], tokenizer_threads: int = 1,
        pipeline_depth: int = 1,
    ) -> None:
        self.config = config
        self.info: ModelInfo = served.info
        self.tokenizer = served.tokenizer
        self.task = served.task
        self.token_rules = embedding.token_rules(served)
        # int8 / uint8 ranges, computed once from the built-in calibration texts on first use.
        self.calibration = quantize.Calibration()
        self.workers = workers
        for worker in workers:
            worker.on_change = self._workers_changed
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix=f"tokenize-{self.info.name}")
        name, budget, max_seqs = self.info.name, config.batch_token_budget, config.max_batch_requests
        self._prefill: PrefillQueue | None = None
        if served.task.tasks != (Task.GENERATE,):
            output = OutputKind.POOL if served.spec.outputs.outputs else OutputKind.SCORE
            self._prefill = PrefillQueue(name, workers, budget, max_seqs, output)
        self._generation: list[GenerationStreams] = []
        if Task.GENERATE in served.task.tasks:
            self._generation = [
                GenerationStreams(
                    name, worker, self._tokenizer_pool, served.eos_token_ids, served.max_model_len, budget, max_seqs,
                    config.enable_prefix_caching,
                )
                for worker in workers
            ]
        generation = self._generation or [None] * len(workers)
        self._loops = [
            WorkerLoop(name, worker, self._prefill, streams, pipeline_depth) for worker, streams in zip(workers, generation)
        ]
        self._started = False
        self._serving = False
        self._serving_listeners: list[Callable[[bool], None]] = []

    @classmethod
    def load(cls, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> Engine:
        """The model in this process on one model thread (blocking; call it off the event loop).

        Every torch call of a model runs on its one model thread, loading included: OpenMP keeps a thread
        team per calling thread, and a second team's idle spinning slows the first by 15-30% on 2 cores.
        """
        if config.data_parallel_size != 1:
            raise ConfigError("an in-process engine runs one replica; use worker processes for --data-parallel-size")
        served = read_served_model(config)
        log_spec(served, config)
        model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{config.served_name}")
        try:
            runner = model_thread.submit(build_runner, config, served.spec).result()
            if warm_up:
                info = served.info
                model_thread.submit(runner.warm_up, info.max_input_tokens, config.batch_token_budget).result()
        except BaseException:
            model_thread.shutdown(wait=False)
            raise
        return cls(config, served, [LocalWorker(runner, model_thread)], tokenizer_threads)

    @classmethod
    def with_worker_processes(cls, config: ModelConfig, tokenizer_threads: int = 1) -> Engine:
        """`config.data_parallel_size` worker processes, started (and waited for) by start(). Blocking: reads
        the model's config and tokenizer, and places the workers."""
        served = read_served_model(config)
        log_spec(served, config)
        num_gpus = torch.cuda.device_count() if config.device != "cpu" else 0
        placements = place_workers(config, num_gpus, available_cores())
        workers = [
            ProcessWorker(index, replace(config, device=placement.device), placement)
            for index, placement in enumerate(placements)
        ]
        return cls(config, served, workers, tokenizer_threads, config.pipeline_depth)

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
        waiting = self._prefill.num_waiting if self._prefill is not None else 0
        return waiting + sum(loop.num_waiting for loop in self._generation)

    @property
    def num_dropped(self) -> int:
        """Queued sequences (prefill) and streams (generation) dropped without running because their call
        went away, since the start."""
        dropped = self._prefill.num_dropped if self._prefill is not None else 0
        return dropped + sum(loop.num_dropped for loop in self._generation)

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
        if self._prefill is not None:
            self._prefill.accepting = True
        self._workers_changed()

    def _workers_changed(self) -> None:
        if self._prefill is not None:
            self._prefill.workers_changed()
        for streams in self._generation:
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
        if self._prefill is not None:
            self._prefill.fail_all(NotReady(f"model {self.info.name} is shutting down; retry on another replica"))
        await asyncio.gather(*(worker.stop() for worker in self.workers))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, decoder_prompt: str = "",
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """Streams the text the model appends to `prompt`; the last delta carries the finish reason.
        Encoder-decoder models: `prompt` is the encoder's input, and the decoder starts from its start token
        followed by `decoder_prompt`; decoder-only models refuse a decoder_prompt. A prompt of token ids is
        used as given; a text prompt gets the model's special tokens unless `add_special_tokens` is False
        (a chat template's output carries its own). `params.max_tokens` None: as many as the context holds.

        The tokenized request goes to the ready worker with the fewest streams and stays there (its KV)."""
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
        ready = [loop for loop in self._generation if loop.is_accepting]
        if not ready:
            raise NotReady(f"no worker of model {self.info.name} is running (restarting); retry shortly")
        loop = min(ready, key=lambda loop: loop.num_streams)
        # Closed at once when the caller stops early, so the stream's KV blocks go back now, not at GC.
        async with aclosing(loop.stream(prepared, params)) as deltas:
            async for delta in deltas:
                yield delta

    def kv_cache_usage(self) -> KvCacheUsage | None:
        """Blocks in use now, summed over the workers (None for models that do not generate)."""
        if not self._generation:
            return None
        usages = [loop.kv_cache_usage() for loop in self._generation]
        return KvCacheUsage(
            block_size=max(u.block_size for u in usages),
            total_blocks=sum(u.total_blocks for u in usages),
            used_blocks=sum(u.used_blocks for u in usages),
            preemptions=sum(u.preemptions for u in usages),
            cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages),
        )

    async def embed(self, texts: list[str], params: EmbedParams) -> EmbedResult:
        """The outputs `params.outputs` names (dense, sparse, token vectors) per text, from one forward pass."""
        received = time.perf_counter()
        checks.check_embed(self.info, self.tokenizer, texts, params)
        if params.chunking:
            return await self.encoded(await chunking.embed_chunked(self, texts, params, received), params)
        encoded = await self.tokenize_with(self.token_rules.encode, self.tokenizer, texts, params)
        return await self._pooled(encoded, params, received)

    async def _pooled(self, encoded: list[Encoded], params: EmbedParams, received: float) -> EmbedResult:
        outputs, prompt_tokens, timing = await self.infer(encoded, received, params.outputs)
        result = embedding.assemble(outputs, encoded, params, self.token_rules, prompt_tokens, timing)
        return await self.encoded(result, params)

    async def encoded(self, result: EmbedResult, params: EmbedParams) -> EmbedResult:
        """The dense vectors in the encoding the call asked for (float32 ones are returned as they are)."""
        if result.embeddings is not None and params.encoding is not Encoding.FLOAT32:
            ranges = await self.calibration.ranges(self, params) if params.encoding in quantize.RANGED else None
            result.embeddings = quantize.encode(result.embeddings, params.encoding, ranges)
        return result

    async def embed_token_ids(self, token_ids: list[list[int]], params: EmbedParams) -> EmbedResult:
        """Embeds pre-tokenized inputs, used as given (OpenAI's token-id `input`; no prompt, no special tokens
        added)."""
        received = time.perf_counter()
        checks.check_embed(self.info, self.tokenizer, token_ids, params)
        if params.prompt_name:
            raise InvalidInput("prompt_name applies to texts; token-id inputs are used as given")
        encoded = await self.tokenize_with(
            self.tokenizer.check_token_ids, token_ids, params.truncate, params.truncation_direction
        )
        return await self._pooled(encoded, params, received)

    async def rerank(self, query: str, documents: list[str], params: RerankParams) -> RerankResult:
        """Documents scored against the query, best first: by the model's score head (cross-encoders,
        yes/no rerankers), by cosine similarity of embeddings (embedders), or by MaxSim of token vectors
        (late-interaction models); with chunking, by each document's best window."""
        received = time.perf_counter()
        checks.require(self.info, Task.RERANK, "Rerank")
        checks.check_rerank(self.info, self.task, query, documents, params)
        mode = self.task.rerank_mode
        if params.chunking:
            return await chunking.rerank_chunked(self, query, documents, params, received)
        if mode is RerankMode.MAXSIM:
            return await multi_vector.rerank_maxsim(self, query, documents, params, received)
        return await reranking.rerank_whole(self, query, documents, params, received)

    async def classify(self, texts: list[str], params: ClassifyParams) -> ClassifyResult:
        """Every label's score per input; with candidate_labels, those labels' zero-shot scores (an NLI model)."""
        received = time.perf_counter()
        checks.require(self.info, Task.CLASSIFY, "Classify")
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        checks.check_direction(params.truncation_direction)
        zero_shot.check_options(params.candidate_labels, params.hypothesis_template, params.multi_label)
        if params.candidate_labels:
            return await self._classify_zero_shot(texts, params, received)
        encoded = await self.tokenize_with(
            self.tokenizer.encode_batch, texts, params.truncate, params.truncation_direction, None
        )
        outputs, prompt_tokens, timing = await self.infer(encoded, received)
        logits = stack_rows(outputs)
        if not params.raw_scores:
            single = logits.shape[1] == 1 or self.task.multi_label
            logits = activate(logits, Activation.SIGMOID if single else Activation.SOFTMAX)
        return ClassifyResult(scores=logits, labels=self.task.labels, prompt_tokens=prompt_tokens, timing=timing)

    async def _classify_zero_shot(self, texts: list[str], params: ClassifyParams, received: float) -> ClassifyResult:
        """transformers' zero-shot-classification pipeline: one scheduler request per (input, label) pair,
        input-major, so the pairs batch with every other call's sequences."""
        entailment = zero_shot.require_entailment(self.task.labels, self.info.name)
        hypotheses = zero_shot.hypotheses(params.candidate_labels, params.hypothesis_template)
        encoded = await self.tokenize_with(
            self.tokenizer.encode_premise_pairs, texts, hypotheses, params.truncate, params.truncation_direction
        )
        outputs, prompt_tokens, timing = await self.infer(encoded, received)
        scores = zero_shot.label_scores(
            stack_rows(outputs), len(texts), entailment, params.multi_label, params.raw_scores
        )
        return ClassifyResult(
            scores=scores, labels=tuple(params.candidate_labels), prompt_tokens=prompt_tokens, timing=timing
        )

    async def tokenize_with(self, encode, *args) -> list[Encoded]:
        """Runs a tokenizer method in the tokenizer pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode, *args)

    async def infer(
        self, encoded: list[Encoded], received: float, wanted: tuple[EmbedOutput, ...] = ()
    ) -> tuple[list[SequenceOutput], int, Timing]:
        """Runs every sequence through the scheduler; outputs in input order, tokens run, and the call's timing."""
        tokenized = time.perf_counter()
        requests = [self._request(e, wanted) for e in encoded]
        outputs = await self._prefill.run(requests)
        first_start = min(output.started for output in outputs)
        last_end = max(output.finished for output in outputs)
        timing = Timing(
            queue_us=_us(first_start - tokenized),
            tokenization_us=_us(tokenized - received),
            inference_us=_us(last_end - first_start),
            total_us=_us(time.perf_counter() - received),
        )
        # Usage counts the input's tokens: an encoder-decoder request's encoder input (its decoder reads the
        # start token or the same input shifted).
        tokens = sum(r.num_encoder_tokens or r.num_tokens for r in requests)
        return outputs, tokens, timing

    def _request(self, encoded: Encoded, wanted: tuple[EmbedOutput, ...] = ()) -> Request:
        ids, types = encoded.ids, encoded.token_type_ids
        pad = self.task.strip_trailing_pad_id
        if pad is not None:
            end = len(ids)
            while end > 1 and ids[end - 1] == pad:
                end -= 1
            ids, types = ids[:end], types[:end] if types is not None else None
        start = self.task.decoder_start_token_id
        if start is not None:
            # Encoder-decoder: the text is the encoder's input; the decoder reads its start token (a yes/no
            # reranker's first step) or the input shifted right behind it (BART's classifier).
            decoder = [start] if self.task.prefill_decoder_input == "start" else [start] + ids[:-1]
            return self._prefill.new_request(decoder, encoder_token_ids=ids)
        return self._prefill.new_request(ids, pool_start=encoded.pool_start, token_type_ids=types, outputs=wanted)

    async def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text the model's chat template makes of `messages` (refused when it has none)."""
        checks.require(self.info, Task.GENERATE, "chat")
        return await self.tokenize_with(self.tokenizer.apply_chat_template, messages)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self.tokenize_with(self.tokenizer.decode, ids, skip_special_tokens)

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[TokenizedText]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_pool, self.tokenizer.tokenize, texts, add_special_tokens, prompt_name
        )
