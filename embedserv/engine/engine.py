"""The asyncio engine of one served model.

Calls tokenize in a thread pool, split into one scheduler request per input, and wait on futures. A
single loop task asks the scheduler for the next batch and runs it on the model thread; the event loop
stays free meanwhile, so new calls are tokenized and queued while the device works.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import numpy as np

from embedserv.config import ModelConfig
from embedserv.engine.generation import GenerationLoop
from embedserv.engine.loading import LoadedModel, load_model
from embedserv.engine.outputs import activate, cosine_to_first, finish_embeddings, rank
from embedserv.engine.tokenizer import Encoded
from embedserv.engine.types import (
    ClassifyParams,
    ClassifyResult,
    EmbedParams,
    EmbedResult,
    GenerationDelta,
    KvCacheUsage,
    ModelInfo,
    RankedDocument,
    RerankParams,
    RerankResult,
    SamplingParams,
    Task,
    Timing,
    TokenizedText,
)
from embedserv.errors import InvalidInput, NotReady
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, PrefillRequest

logger = logging.getLogger(__name__)


# Prompt length of the generation warm-up (one prefill, then a few decode steps).
_GENERATION_WARM_UP_TOKENS = 64


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


class Engine:
    def __init__(
        self, config: ModelConfig, loaded: LoadedModel, model_thread: ThreadPoolExecutor, tokenizer_threads: int = 1
    ) -> None:
        self.config = config
        self.info: ModelInfo = loaded.info
        self.tokenizer = loaded.tokenizer
        self.task = loaded.task
        self._runner = loaded.runner
        self._scheduler = PrefillOnlyScheduler(config.batch_token_budget, config.max_batch_requests)
        self._futures: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix=f"tokenize-{self.info.name}")
        self._model_thread = model_thread
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._generation: GenerationLoop | None = None
        if loaded.generation is not None:
            self._generation = GenerationLoop(
                self.info.name, loaded.generation, self.tokenizer, model_thread, self._tokenizer_pool,
                config.batch_token_budget, config.max_batch_requests, config.enable_prefix_caching,
            )

    @classmethod
    def load(cls, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> Engine:
        """Loads weights and tokenizer (blocking; call it off the event loop) and warms the model up.

        Every torch call of a model runs on its one model thread, loading included: OpenMP keeps a thread
        team per calling thread, and a second team's idle spinning slows the first by 15-30% on 2 cores.
        """
        model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{config.served_name}")
        try:
            loaded = model_thread.submit(load_model, config).result()
            if warm_up and loaded.runner is not None:
                model_thread.submit(
                    loaded.runner.warm_up, loaded.info.max_input_tokens, config.batch_token_budget
                ).result()
            if warm_up and loaded.generation is not None:
                model_thread.submit(loaded.generation.runner.warm_up, _GENERATION_WARM_UP_TOKENS).result()
        except BaseException:
            model_thread.shutdown(wait=False)
            raise
        return cls(config, loaded, model_thread, tokenizer_threads)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name=f"engine-{self.info.name}")
        self._loop_task.add_done_callback(self._on_loop_exit)
        if self._generation is not None:
            self._generation.start()

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        """A crashed loop must not leave callers waiting forever: fail what is pending."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("engine loop of %s died", self.info.name, exc_info=task.exception())
        self._fail_pending(NotReady(f"model {self.info.name} stopped after an internal error; retry later"))

    def _fail_pending(self, error: Exception) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()

    async def stop(self) -> None:
        if self._generation is not None:
            await self._generation.stop()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_pending(NotReady(f"model {self.info.name} is shutting down; retry on another replica"))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._model_thread.shutdown(wait=True)

    def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[GenerationDelta]:
        """Streams the text the model appends to `prompt`; the last delta carries the finish reason."""
        self._require(Task.GENERATE, "Generate")
        return self._generation.generate(prompt, params)

    def kv_cache_usage(self) -> KvCacheUsage | None:
        """Blocks in use now (None for models that do not generate)."""
        return self._generation.kv_cache_usage() if self._generation is not None else None

    async def embed(self, texts: list[str], params: EmbedParams) -> EmbedResult:
        received = time.perf_counter()
        self._require(Task.EMBED, "Embed")
        self._check_params(texts, params)
        encoded = await self._tokenize_with(
            self.tokenizer.encode_batch, texts, params.truncate, params.truncation_direction, params.prompt_name
        )
        rows, prompt_tokens, timing = await self._infer(encoded, received)
        return EmbedResult(
            embeddings=finish_embeddings(rows, params.dimensions, params.normalize),
            prompt_tokens=prompt_tokens,
            timing=timing,
        )

    async def rerank(self, query: str, documents: list[str], params: RerankParams) -> RerankResult:
        """Documents scored against the query, best first: by the model's score head (cross-encoders,
        yes/no rerankers) or by cosine similarity of embeddings (embedders)."""
        received = time.perf_counter()
        self._require(Task.RERANK, "Rerank")
        self._check_rerank(query, documents, params)
        mode = self.task.rerank_mode
        if mode == "embeddings":
            encoded = await self._tokenize_with(self._encode_for_cosine, query, documents, params.truncate)
        elif mode == "pair":
            encoded = await self._tokenize_with(self.tokenizer.encode_pairs, query, documents, params.truncate)
        else:
            instruction = params.instruction or self.task.template.default_instruction
            encoded = await self._tokenize_with(
                self.tokenizer.encode_templated, self.task.template, instruction, query, documents, params.truncate
            )
        rows, prompt_tokens, timing = await self._infer(encoded, received)
        if mode == "embeddings":
            scores = cosine_to_first(rows)
        else:
            scores = rows[:, 0] if params.raw_scores else activate(rows, self.task.rerank_activation)[:, 0]
        results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
        return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)

    async def classify(self, texts: list[str], params: ClassifyParams) -> ClassifyResult:
        received = time.perf_counter()
        self._require(Task.CLASSIFY, "Classify")
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        self._check_direction(params.truncation_direction)
        encoded = await self._tokenize_with(
            self.tokenizer.encode_batch, texts, params.truncate, params.truncation_direction, None
        )
        logits, prompt_tokens, timing = await self._infer(encoded, received)
        if not params.raw_scores:
            single = logits.shape[1] == 1 or self.task.multi_label
            logits = activate(logits, "sigmoid" if single else "softmax")
        return ClassifyResult(scores=logits, labels=self.task.labels, prompt_tokens=prompt_tokens, timing=timing)

    def _encode_for_cosine(self, query: str, documents: list[str], truncate: bool) -> list[Encoded]:
        """The query (never cut) and the documents with the prompts sentence-transformers' encode_query /
        encode_document pick: "query"; "document", "passage" or "corpus"; else the default prompt."""
        prompts = self.tokenizer.prompts
        query_prompt = "query" if "query" in prompts else None
        document_prompt = next((n for n in ("document", "passage", "corpus") if n in prompts), None)
        try:
            encoded_query = self.tokenizer.encode_batch([query], False, "right", query_prompt)
        except InvalidInput:
            raise InvalidInput(
                f"the query is longer than the model's limit of {self.tokenizer.max_input_tokens} tokens "
                "(queries are never truncated); shorten the query"
            ) from None
        return encoded_query + self.tokenizer.encode_batch(documents, truncate, "right", document_prompt)

    async def _tokenize_with(self, encode, *args) -> list[Encoded]:
        """Runs a tokenizer method in the tokenizer pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode, *args)

    async def _infer(self, encoded: list[Encoded], received: float) -> tuple[np.ndarray, int, Timing]:
        """Runs every sequence through the scheduler; rows in input order, tokens run, and the call's timing."""
        tokenized = time.perf_counter()
        requests = [self._request(e) for e in encoded]
        outputs = await self._run_requests(requests)
        first_start = min(start for _, start, _ in outputs)
        last_end = max(end for _, _, end in outputs)
        timing = Timing(
            queue_us=_us(first_start - tokenized),
            tokenization_us=_us(tokenized - received),
            inference_us=_us(last_end - first_start),
            total_us=_us(time.perf_counter() - received),
        )
        return np.stack([row for row, _, _ in outputs]), sum(r.num_tokens for r in requests), timing

    def _request(self, encoded: Encoded) -> PrefillRequest:
        ids, types = encoded.ids, encoded.token_type_ids
        pad = self.task.strip_trailing_pad_id
        if pad is not None:
            end = len(ids)
            while end > 1 and ids[end - 1] == pad:
                end -= 1
            ids, types = ids[:end], types[:end] if types is not None else None
        return PrefillRequest(next(self._ids), ids, pool_start=encoded.pool_start, token_type_ids=types)

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[TokenizedText]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_pool, self.tokenizer.tokenize, texts, add_special_tokens, prompt_name
        )

    def _require(self, task: Task, rpc: str) -> None:
        if task not in self.info.tasks:
            tasks = ", ".join(t.value for t in self.info.tasks)
            raise InvalidInput(f"model {self.info.name!r} cannot serve {rpc}; it serves: {tasks}")

    @staticmethod
    def _check_direction(direction: str) -> None:
        if direction not in ("right", "left"):
            raise InvalidInput(f"truncation_direction must be right or left, not {direction!r}")

    def _check_params(self, texts: list[str], params: EmbedParams) -> None:
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        if params.dimensions is not None and not 1 <= params.dimensions <= self.info.dimension:
            raise InvalidInput(
                f"dimensions must be between 1 and the model's dimension {self.info.dimension}, "
                f"not {params.dimensions}"
            )
        self._check_direction(params.truncation_direction)
        # Unknown prompt names fail before any tokenizing.
        self.tokenizer.resolve_prompt(params.prompt_name)

    def _check_rerank(self, query: str, documents: list[str], params: RerankParams) -> None:
        if not query:
            raise InvalidInput("query is empty; send the text to rank documents against")
        if not documents:
            raise InvalidInput("documents is empty; send at least one document to rank")
        if params.top_n is not None and params.top_n < 1:
            raise InvalidInput(f"top_n must be at least 1 (or unset for all results), not {params.top_n}")
        if params.instruction and self.task.template is None:
            raise InvalidInput(
                f"model {self.info.name!r} takes no instruction (only instruction-following rerankers do); "
                "leave instruction empty"
            )

    async def _run_requests(self, requests: list[PrefillRequest]) -> list[tuple]:
        if not self.is_running:
            raise NotReady(f"model {self.info.name} is not running; retry shortly")
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            future = loop.create_future()
            self._futures[request.request_id] = future
            self._scheduler.add(request)
            futures.append(future)
        self._wakeup.set()
        try:
            return await asyncio.gather(*futures)
        except BaseException:
            # The caller went away (or a batch failed): drop what has not run yet.
            for request, future in zip(requests, futures):
                request.cancelled = True
                self._futures.pop(request.request_id, None)
                future.cancel()
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._scheduler.schedule()
            if batch is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = time.perf_counter()
            try:
                output = await loop.run_in_executor(self._model_thread, self._runner.execute, batch)
            except Exception as exc:
                logger.exception("batch of %d sequences failed on %s", batch.num_sequences, self.info.name)
                for seq in batch.sequences:
                    future = self._futures.pop(seq.request_id, None)
                    if future is not None and not future.done():
                        future.set_exception(RuntimeError(f"inference failed: {exc}"))
                continue
            finished = time.perf_counter()
            logger.debug(
                "%s: batch of %d sequences, %d tokens in %.1f ms",
                self.info.name, batch.num_sequences, batch.num_tokens, (finished - started) * 1e3,
            )
            for request_id, row in zip(output.request_ids, output.rows):
                future = self._futures.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result((row, started, finished))
