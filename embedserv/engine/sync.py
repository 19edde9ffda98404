"""A blocking wrapper around Engine for scripts, benchmarks and tests: its own event loop in a thread."""

from __future__ import annotations

import asyncio
import threading

from embedserv.config import ModelConfig
from embedserv.engine.engine import Engine
from embedserv.engine.types import (
    ClassifyParams,
    ClassifyResult,
    EmbedParams,
    EmbedResult,
    ModelInfo,
    RerankParams,
    RerankResult,
)


class SyncEngine:
    def __init__(self, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> None:
        self.engine = Engine.load(config, tokenizer_threads=tokenizer_threads, warm_up=warm_up)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-engine-loop", daemon=True)
        self._thread.start()
        self._call(self.engine.start())

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def embed(self, texts: list[str], params: EmbedParams | None = None) -> EmbedResult:
        return self._call(self.engine.embed(list(texts), params or EmbedParams()))

    def rerank(self, query: str, documents: list[str], params: RerankParams | None = None) -> RerankResult:
        return self._call(self.engine.rerank(query, list(documents), params or RerankParams()))

    def rerank_concurrently(
        self, calls: list[tuple[str, list[str]]], params: RerankParams | None = None
    ) -> list[RerankResult]:
        """(query, documents) calls submitted at once, as concurrent clients would."""

        async def run() -> list[RerankResult]:
            return await asyncio.gather(*(self.engine.rerank(q, list(d), params or RerankParams()) for q, d in calls))

        return self._call(run())

    def classify(self, texts: list[str], params: ClassifyParams | None = None) -> ClassifyResult:
        return self._call(self.engine.classify(list(texts), params or ClassifyParams()))

    async def _embed_many(self, calls: list[list[str]], params: EmbedParams) -> list[EmbedResult]:
        return await asyncio.gather(*(self.engine.embed(texts, params) for texts in calls))

    def embed_concurrently(self, calls: list[list[str]], params: EmbedParams | None = None) -> list[EmbedResult]:
        """Submits all calls at once, as concurrent clients would, so the scheduler can pack them."""
        return self._call(self._embed_many(calls, params or EmbedParams()))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
