"""One served model as the faces see it: its task services, built over its Core (engine/ports.py).

The Core is a LocalCore where the workers are this process's, and a RemoteCore in a front-end process; the
services (engine/tasks/) are the same either way. The faces call the services; health, ListModels and the
generation streams read the Core itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from embedserv.config import ModelConfig
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import Core, CoreStatus, Inferred
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks.classification import Classification
from embedserv.engine.tasks.embedding import Embedding
from embedserv.engine.tasks.reranking import Reranking
from embedserv.engine.tasks.token_classification import TokenClassification
from embedserv.engine.tasks.tokens import Tokens
from embedserv.types import EmbedOutput, GenerationDelta, ModelInfo, SamplingParams

T = TypeVar("T")


class Engine:
    def __init__(self, config: ModelConfig, served: ServedModel, core: Core) -> None:
        self.config = config
        self.info: ModelInfo = served.info
        self.served = served
        self.core = core
        self.embedding = Embedding(core, served, config.allow_pickle)
        self.reranking = Reranking(core, served, self.embedding.token_rules)
        self.classification = Classification(core, served)
        self.token_classification = TokenClassification(core, served)
        self.tokens = Tokens(core, served)

    def for_adapter(self, name: str) -> Engine:
        """The model as its --lora adapter `name` is served: the same core, workers and tokenizer, every
        sequence run with that adapter; its own ModelInfo names the base."""
        index = self.info.lora_adapters.index(name)
        info = replace(self.info, name=name, base_model=self.info.name, lora_adapters=())
        served = replace(self.served, spec=replace(self.served.spec, info=info))
        return Engine(self.config, served, AdapterCore(self.core, index))


class AdapterCore:
    """A Core as a --lora adapter's services see it: every sequence runs with the adapter (its index in the
    base's lora_adapters, which the scheduler carries to the workers as jina-v3's task adapters go);
    everything else is the base's."""

    def __init__(self, base: Core, adapter: int) -> None:
        self.base = base
        self.adapter = adapter

    def status(self) -> CoreStatus:
        return self.base.status()

    async def tokenize_with(self, encode: Callable[..., T], *args: Any, chars: int | None = None) -> T:
        return await self.base.tokenize_with(encode, *args, chars=chars)

    async def infer(
        self,
        sequences: list[InputSequence],
        received: float,
        wanted: tuple[EmbedOutput, ...] = (),
        use_cache: bool = True,
    ) -> Inferred:
        # The adapter joins each sequence, and so the embedding cache's key (every field of InputSequence).
        sequences = [replace(sequence, adapter=self.adapter) for sequence in sequences]
        return await self.base.infer(sequences, received, wanted, use_cache)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        decoder_prompt: str = "",
        add_special_tokens: bool = True,
        stream: bool = True,
    ) -> AsyncIterator[GenerationDelta]:
        return self.base.generate(prompt, params, decoder_prompt, add_special_tokens, stream)
