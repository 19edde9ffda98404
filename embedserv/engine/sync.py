"""A blocking wrapper around one model's LocalCore and Engine for scripts, benchmarks and tests: its own event loop
in a thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

from embedserv.config import ModelConfig
from embedserv.engine.core.local_core import LocalCore
from embedserv.engine.core.output_cache import CacheStats
from embedserv.engine.engine import Engine
from embedserv.engine.tasks.token_classification import TokenClassifyParams, TokenClassifyResult
from embedserv.executor.base import WorkerStats
from embedserv.types import (
    ClassifyParams,
    ClassifyResult,
    EmbedInput,
    EmbedParams,
    EmbedResult,
    GenerationDelta,
    ImageInput,
    KvCacheUsage,
    ModelInfo,
    RerankParams,
    RerankResult,
    SamplingParams,
)


class SyncEngine:
    def __init__(
        self,
        config: ModelConfig,
        tokenizer_threads: int = 1,
        warm_up: bool | None = None,
        worker_processes: bool = False,
    ) -> None:
        """The model runs in this process, or with `worker_processes` in config.data_parallel_size worker
        processes, as the server runs it. It warms up as config.warm_up says; `warm_up` overrides that in this
        process (worker processes follow config.warm_up)."""
        if worker_processes:
            self.core = LocalCore.with_worker_processes(config, tokenizer_threads=tokenizer_threads)
        else:
            warm = config.warm_up if warm_up is None else warm_up
            self.core = LocalCore.load(config, tokenizer_threads=tokenizer_threads, warm_up=warm)
        self.engine = Engine(config, self.core.served, self.core)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-engine-loop", daemon=True)
        self._thread.start()
        try:
            self._call(self.core.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def embed(self, texts: list[EmbedInput], params: EmbedParams | None = None) -> EmbedResult:
        return self._call(self.engine.embedding.embed(list(texts), params or EmbedParams()))

    def encoded(self, result: EmbedResult, params: EmbedParams) -> EmbedResult:
        """A copy of `result` (float32 vectors) in `params.encoding`, by the step Embedding.embed ends with."""
        return self._call(self.engine.embedding.in_encoding(replace(result), params))

    def rerank(
        self, query: str | ImageInput, documents: list[str | ImageInput], params: RerankParams | None = None
    ) -> RerankResult:
        return self._call(self.engine.reranking.rerank(query, list(documents), params or RerankParams()))

    def rerank_concurrently(
        self, calls: list[tuple[str, list[str]]], params: RerankParams | None = None
    ) -> list[RerankResult]:
        """(query, documents) calls submitted at once, as concurrent clients would."""

        async def run() -> list[RerankResult]:
            rerank = self.engine.reranking.rerank
            return await asyncio.gather(*(rerank(q, list(d), params or RerankParams()) for q, d in calls))

        return self._call(run())

    def classify(self, texts: list[str], params: ClassifyParams | None = None) -> ClassifyResult:
        return self._call(self.engine.classification.classify(list(texts), params or ClassifyParams()))

    def classify_tokens(self, texts: list[str], params: TokenClassifyParams | None = None) -> TokenClassifyResult:
        classify = self.engine.token_classification.classify_tokens
        return self._call(classify(list(texts), params or TokenClassifyParams()))

    async def _embed_many(self, calls: list[list[str]], params: EmbedParams) -> list[EmbedResult]:
        return await asyncio.gather(*(self.engine.embedding.embed(texts, params) for texts in calls))

    def embed_concurrently(self, calls: list[list[str]], params: EmbedParams | None = None) -> list[EmbedResult]:
        """Submits all calls at once, as concurrent clients would, so the scheduler can pack them."""
        return self._call(self._embed_many(calls, params or EmbedParams()))

    def generate(self, prompt: str, params: SamplingParams) -> list[GenerationDelta]:
        """Every delta of one generation, the last one carrying the finish reason."""
        return self.generate_concurrently([prompt], [params])[0]

    def generate_concurrently(
        self, prompts: list[str], params: list[SamplingParams], on_delta=None, decoder_prompts: list[str] | None = None
    ) -> list[list[GenerationDelta]]:
        """Generations submitted at once, as concurrent streams would be. `on_delta(index, delta)` is called
        (on the engine's loop) as each delta arrives, e.g. to time the first token. `decoder_prompts`: one
        per prompt, for encoder-decoder models."""

        async def collect(index: int, prompt: str, p: SamplingParams) -> list[GenerationDelta]:
            deltas = []
            decoder_prompt = decoder_prompts[index] if decoder_prompts else ""
            async for delta in self.core.generate(prompt, p, decoder_prompt=decoder_prompt):
                if on_delta is not None:
                    on_delta(index, delta)
                deltas.append(delta)
            return deltas

        async def run() -> list[list[GenerationDelta]]:
            return await asyncio.gather(
                *(collect(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)))
            )

        return self._call(run())

    def kv_cache_usage(self) -> KvCacheUsage | None:
        return self.core.kv_cache_usage()

    def embedding_cache_stats(self) -> CacheStats | None:
        return self.core.stats().cache

    def worker_stats(self) -> list[WorkerStats]:
        return [worker.stats() for worker in self.core.workers]

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self.core.stop())
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
