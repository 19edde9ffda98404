"""The asyncio engine of one served model: the facade the server, the clients' tests and the benchmarks use.

It wires the engine core (core/engine_core.py: workers, step loops, `infer`, `generate`) to the task
services (tasks/: embedding, encodings, rerank, classification), which see the core only through the
port of ports.py. Calls tokenize in a thread pool, become one scheduler request per input, and wait on
futures; the event loop stays free meanwhile.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, AsyncIterator, Callable, TypeVar

from embedserv.config import ModelConfig
from embedserv.engine import checks
from embedserv.engine.core import workers as worker_builders
from embedserv.engine.core.engine_core import EngineCore
from embedserv.engine.core.output_cache import CacheStats
from embedserv.engine.served_model import ServedModel, log_spec, read_served_model
from embedserv.engine.tasks.classification import Classification
from embedserv.engine.tasks.embedding import Embedding
from embedserv.engine.tasks.quantize import Encodings
from embedserv.engine.tasks.reranking import Reranking
from embedserv.errors import ConfigError
from embedserv.executor.base import Worker, WorkerStats
from embedserv.scheduler.load import ModelLoad
from embedserv.types import (
    ClassifyParams, ClassifyResult, EmbedParams, EmbedResult, GenerationDelta, ImageInput, KvCacheUsage, ModelInfo,
    RerankParams, RerankResult, SamplingParams, Task, TokenizedText,
)

Params = TypeVar("Params", EmbedParams, RerankParams, ClassifyParams)


class Engine:
    def __init__(
        self, config: ModelConfig, served: ServedModel, workers: list[Worker] | None = None, tokenizer_threads: int = 1,
        pipeline_depth: int = 1, core: EngineCore | None = None,
    ) -> None:
        """`core` given (a front-end process's RemoteCore, server/remote_core.py) stands in for the workers."""
        self.config = config
        self.info: ModelInfo = served.info
        self.served = served
        self.tokenizer = served.tokenizer
        self.task = served.task
        self.core = core or EngineCore(config, served, workers, tokenizer_threads, pipeline_depth)
        self.embedding = Embedding(self.core, served, config.allow_pickle)
        # int8 / uint8 ranges, computed once from the built-in calibration texts on first use.
        self.encodings = Encodings(self.embedding)
        self.reranking = Reranking(self.core, served, self.embedding.token_rules)
        self.classification = Classification(self.core, served)

    @classmethod
    def load(cls, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> Engine:
        """The model in this process on one model thread (blocking; call it off the event loop)."""
        if config.data_parallel_size != 1:
            raise ConfigError("an in-process engine runs one replica; use worker processes for --data-parallel-size")
        served = read_served_model(config)
        log_spec(served, config)
        worker = worker_builders.load_local_worker(config, served.spec, warm_up)
        return cls(config, served, [worker], tokenizer_threads, config.pipeline_depth)

    @classmethod
    def with_worker_processes(cls, config: ModelConfig, tokenizer_threads: int = 1) -> Engine:
        """`config.data_parallel_size` worker processes, started (and waited for) by start(). Blocking: reads
        the model's config and tokenizer, and places the workers."""
        served = read_served_model(config)
        log_spec(served, config)
        workers = worker_builders.worker_processes(config)
        return cls(config, served, workers, tokenizer_threads, config.pipeline_depth)

    def adapter_engine(self, name: str) -> Engine:
        """The engine as its --lora adapter `name` is served: the same core, workers and tokenizer, every
        sequence run with that adapter; its own ModelInfo names the base. Never started or stopped itself."""
        index = self.info.lora_adapters.index(name)
        info = replace(self.info, name=name, base_model=self.info.name, lora_adapters=())
        served = replace(self.served, spec=replace(self.served.spec, info=info))
        return Engine(self.config, served, core=_AdapterCore(self.core, index))

    @property
    def workers(self) -> list[Worker]:
        return self.core.workers

    @property
    def is_running(self) -> bool:
        """Started, not stopped, and no loop crashed (workers may be restarting)."""
        return self.core.is_running

    @property
    def is_serving(self) -> bool:
        """Running with at least one worker ready: what health reports for this model."""
        return self.core.is_serving

    def add_serving_listener(self, listener: Callable[[bool], None]) -> None:
        """`listener(is_serving)` is called on the event loop whenever is_serving flips."""
        self.core.add_serving_listener(listener)

    def worker_stats(self) -> list[WorkerStats]:
        return self.core.worker_stats()

    @property
    def num_waiting(self) -> int:
        """Sequences queued for a first batch (prefill) or a first step (generation)."""
        return self.core.num_waiting

    def current_load(self) -> ModelLoad | None:
        """Calls waiting and running, waiting tokens, the workers' busy share (None in a front-end process: the
        engine process counts them)."""
        return self.core.current_load()

    @property
    def num_dropped(self) -> int:
        """Queued sequences and streams dropped without running because their call went away."""
        return self.core.num_dropped

    async def start(self) -> None:
        """Starts every worker and waits until all are ready; if one cannot start, stops the rest and raises."""
        await self.core.start()

    async def stop(self) -> None:
        await self.core.stop()

    def generate(
        self, prompt: str | list[int], params: SamplingParams, decoder_prompt: str = "",
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        """Streams the text the model appends to `prompt`; the last delta carries the finish reason.
        Encoder-decoder models: `prompt` is the encoder's input, and the decoder starts from its start token
        followed by `decoder_prompt`; decoder-only models refuse a decoder_prompt. A prompt of token ids is
        used as given; a text prompt gets the model's special tokens unless `add_special_tokens` is False
        (a chat template's output carries its own). `params.max_tokens` None: as many as the context holds."""
        return self.core.generate(prompt, params, decoder_prompt, add_special_tokens)

    def kv_cache_usage(self) -> KvCacheUsage | None:
        """Blocks in use now, summed over the workers (None for models that do not generate)."""
        return self.core.kv_cache_usage()

    def embedding_cache_stats(self) -> CacheStats | None:
        """The embedding cache's counters (None without one, and in a front-end process: the engine process
        has it)."""
        return self.core.cache_stats()

    def truncates(self, requested: bool | None) -> bool:
        """Whether a call cuts too-long inputs: its own `truncate` when it says one, else the model's
        --auto-truncate. Every face's calls are resolved here, so the default lives in one place."""
        return self.info.auto_truncate if requested is None else requested

    def _truncating(self, params: Params) -> Params:
        return params if params.truncate is not None else replace(params, truncate=self.truncates(None))

    async def embed(self, texts: list[str | ImageInput], params: EmbedParams) -> EmbedResult:
        """The outputs `params.outputs` names (dense, sparse, token vectors) per input, from one forward pass,
        the dense vectors in the call's encoding. Inputs are texts, or images (encoded bytes) for models whose
        modalities include IMAGE; one call may mix them."""
        params = self._truncating(params)
        return await self.encodings.apply(await self.embedding.embed(texts, params), params)

    async def embed_token_ids(self, token_ids: list[list[int]], params: EmbedParams) -> EmbedResult:
        """Embeds pre-tokenized inputs, used as given (OpenAI's token-id `input`; no prompt, no special tokens
        added)."""
        params = self._truncating(params)
        return await self.encodings.apply(await self.embedding.embed_token_ids(token_ids, params), params)

    async def encoded(self, result: EmbedResult, params: EmbedParams) -> EmbedResult:
        """The dense vectors in the encoding the call asked for (float32 ones are returned as they are)."""
        return await self.encodings.apply(result, params)

    async def rerank(self, query: str, documents: list[str | ImageInput], params: RerankParams) -> RerankResult:
        """Documents scored against the query, best first: by the model's score head (cross-encoders,
        yes/no rerankers), by cosine similarity of embeddings (embedders), or by MaxSim of token vectors
        (late-interaction models); with chunking, by each document's best window. Documents may be images
        (encoded bytes) for models whose modalities include IMAGE: text-image dual encoders rank them by
        cosine, ColQwen2 / ColPali (page images only) by MaxSim."""
        return await self.reranking.rerank(query, documents, self._truncating(params))

    async def classify(self, texts: list[str], params: ClassifyParams) -> ClassifyResult:
        """Every label's score per input; with candidate_labels, those labels' zero-shot scores (an NLI model)."""
        return await self.classification.classify(texts, self._truncating(params))

    async def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text the model's chat template makes of `messages` (refused when it has none)."""
        checks.require(self.info, Task.GENERATE, "chat")
        return await self.core.tokenize_with(self.tokenizer.apply_chat_template, messages)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self.core.tokenize_with(self.tokenizer.decode, ids, skip_special_tokens)

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[TokenizedText]:
        return await self.core.tokenize_with(self.tokenizer.tokenize, texts, add_special_tokens, prompt_name)


class _AdapterCore:
    """An engine core as a --lora adapter's services see it: every sequence runs with the adapter (its index in
    the base's lora_adapters, which the scheduler carries to the workers as jina-v3's task adapters go)."""

    def __init__(self, core, adapter: int) -> None:
        self._core = core
        self._adapter = adapter

    def __getattr__(self, name: str) -> Any:
        # Everything but infer is the base's: workers, health, stats, the tokenizer pool.
        return getattr(self._core, name)

    async def infer(self, encoded: list, received: float, *args: Any, **kwargs: Any):
        # The adapter joins each sequence, and so the embedding cache's key (every field of Encoded).
        encoded = [replace(e, adapter=self._adapter) for e in encoded]
        return await self._core.infer(encoded, received, *args, **kwargs)
