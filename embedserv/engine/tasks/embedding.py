"""Embed's host side: how a model's inputs are tokenized per output, and how each sequence's step outputs
become the dense, sparse and multi-vector results a call returns (float32; quantize.py encodes them after).

A model's `TokenRules` (token_rules.py) decide what is model-specific about token vectors: which tokens'
vectors are returned (all of them for last hidden states, all but the first for bge-m3's colbert head, the
MultiVectorEncoder's masks for its models) and, for late-interaction models, how queries and documents are
tokenized (multi_vector.py).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from embedserv.engine import checks
from embedserv.engine.inputs import image_inputs
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.ports import Core, SequenceOutput
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks import chunking, late_chunking
from embedserv.engine.tasks.outputs import finish_embeddings, stack_rows
from embedserv.engine.tasks.quantize import Encodings
from embedserv.errors import InvalidInput
from embedserv.types import (
    EmbedInput,
    EmbedOutput,
    EmbedParams,
    EmbedResult,
    Encoding,
    ModelInfo,
    SparseVector,
    Task,
    Timing,
)


class Embedding:
    """Embed and its token-id form, through the model's Core: the outputs a call asks for, the dense vectors in
    its encoding."""

    def __init__(self, core: Core, served: ServedModel, allow_pickle: bool = False) -> None:
        self._core = core
        self._served = served
        self._info = served.info
        self._tokenizer = served.tokenizer
        self.token_rules = served.token_rules
        self._encode_texts = self.token_rules.text_encoder(self._tokenizer)
        # Late chunking's copy of the model's Dense modules, read on its first call.
        self._dense = late_chunking.HostDense(served, allow_pickle)
        # int8 / uint8 ranges, computed once from the built-in calibration texts on first use.
        self.encodings = Encodings(self)

    async def embed(self, inputs: list[EmbedInput], params: EmbedParams) -> EmbedResult:
        """The outputs `params.outputs` names (dense, sparse, token vectors) per input, from one forward pass,
        the dense vectors in the call's encoding. Inputs are texts, or images (encoded bytes) for models whose
        modalities include IMAGE, or texts and images interleaved for those whose token rules take them; one call
        may mix them."""
        if params.truncate is None:
            params = replace(params, truncate=self._info.auto_truncate)  # the model's --auto-truncate
        result = await self.embed_floats(inputs, params)
        return result if params.encoding is Encoding.FLOAT32 else await self.encodings.apply(result, params)

    async def embed_token_ids(self, token_ids: list[list[int]], params: EmbedParams) -> EmbedResult:
        """Embeds pre-tokenized inputs, used as given (OpenAI's token-id `input`; no prompt, no special tokens
        added)."""
        if params.truncate is None:
            params = replace(params, truncate=self._info.auto_truncate)
        received = time.perf_counter()
        tokenizer = self._tokenizer
        check_embed(self._info, tokenizer, token_ids, params)
        if params.prompt_name:
            raise InvalidInput("prompt_name applies to texts; token-id inputs are used as given")
        if params.late_chunking is not None:
            raise InvalidInput("late_chunking applies to texts (its spans are character offsets); send texts")
        # A task picks the adapter only: token ids get no prompt.
        adapter, _ = task_adapter(self._info, tokenizer, params)
        encoded = await self._core.tokenize_with(
            tokenizer.check_token_ids, token_ids, params.truncate, params.truncation_direction
        )
        self.token_rules.check_ids(encoded)
        result = await self._pooled(encoded, adapter, params, received)
        return result if params.encoding is Encoding.FLOAT32 else await self.encodings.apply(result, params)

    async def embed_floats(self, inputs: list[EmbedInput], params: EmbedParams) -> EmbedResult:
        """embed() with float32 dense vectors, `truncate` as given (calibration embeds through this)."""
        received = time.perf_counter()
        tokenizer = self._tokenizer
        adapter, prompt_name = task_adapter(self._info, tokenizer, params)
        params = replace(params, prompt_name=prompt_name)
        has_images = bool(image_inputs.image_indices(inputs))
        if has_images or self._served.vision is not None:
            image_inputs.check_call(self._served, inputs, params)
        check_embed(self._info, tokenizer, inputs, params)
        if has_images:
            encoded = await image_inputs.encode_inputs(self._core, self._served, self.token_rules, inputs, params)
            return await self._pooled(encoded, adapter, params, received)
        if params.late_chunking is not None:
            return await late_chunking.embed_late_chunks(
                self._core, self._served, inputs, params, received, self._dense, adapter
            )
        if params.chunking:
            return await chunking.embed_chunked(self._core, self._served, inputs, params, received, adapter)
        encoded = await self._core.tokenize_with(self._encode_texts, inputs, params, chars=sum(map(len, inputs)))
        return await self._pooled(encoded, adapter, params, received)

    async def in_encoding(self, result: EmbedResult, params: EmbedParams) -> EmbedResult:
        """`result`'s float32 dense vectors in the encoding `params` asks for."""
        return await self.encodings.apply(result, params)

    async def _pooled(
        self, encoded: list[InputSequence], adapter: int, params: EmbedParams, received: float
    ) -> EmbedResult:
        """The sequences run (with the task adapter `adapter`, -1: none) and their outputs assembled."""
        if adapter >= 0:
            encoded = [replace(e, adapter=adapter) for e in encoded]
        outputs, prompt_tokens, timing = await self._core.infer(
            encoded, received, params.outputs, use_cache=not params.bypass_cache
        )
        return assemble(outputs, encoded, params, self.token_rules, prompt_tokens, timing)


_OUTPUT_RPCS = {
    EmbedOutput.DENSE: "Embed",
    EmbedOutput.SPARSE: "EmbedSparse",
    EmbedOutput.MULTI_VECTOR: "EmbedMultiVector",
}
_OUTPUT_TASKS = {
    EmbedOutput.DENSE: Task.EMBED,
    EmbedOutput.SPARSE: Task.EMBED_SPARSE,
    EmbedOutput.MULTI_VECTOR: Task.EMBED_MULTI_VECTOR,
}


def check_outputs(info: ModelInfo, params: EmbedParams) -> None:
    """Every output asked for is one the model gives; the options fit the outputs."""
    if not params.outputs:
        raise InvalidInput("outputs is empty; ask for at least one of dense, sparse, multi_vector")
    if len(set(params.outputs)) != len(params.outputs):
        raise InvalidInput(f"outputs names an output twice: {', '.join(map(str, params.outputs))}")
    if len(params.outputs) == 1 and _OUTPUT_TASKS[params.outputs[0]] not in info.tasks:
        raise checks.not_served(info, _OUTPUT_RPCS[params.outputs[0]])
    missing = [str(o) for o in params.outputs if o not in info.outputs]
    if missing:
        gives = ", ".join(map(str, info.outputs)) or "none (it does not embed)"
        raise InvalidInput(f"model {info.name!r} cannot give the {', '.join(missing)} output; its outputs: {gives}")
    if params.sparse_top_k is not None:
        if EmbedOutput.SPARSE not in params.outputs:
            raise InvalidInput("top_k applies to the sparse output; ask for it or leave top_k unset")
        if params.sparse_top_k < 1:
            raise InvalidInput(
                f"top_k must be at least 1 (or unset for every non-zero value), not {params.sparse_top_k}"
            )
    if params.dimensions is not None and EmbedOutput.DENSE not in params.outputs:
        raise InvalidInput("dimensions applies to the dense output; leave it unset for sparse and multi-vector outputs")


def check_embed(info: ModelInfo, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> None:
    check_outputs(info, params)
    if not texts:
        raise InvalidInput("inputs is empty; send at least one text")
    if params.dimensions is not None and not 1 <= params.dimensions <= info.dimension:
        raise InvalidInput(
            f"dimensions must be between 1 and the model's dimension {info.dimension}, not {params.dimensions}"
        )
    if params.truncation_direction not in checks.DIRECTIONS:
        raise checks.bad_direction(params.truncation_direction)
    # Unknown prompt names fail before any tokenizing.
    tokenizer.resolve_prompt(params.prompt_name)


def task_adapter(info: ModelInfo, tokenizer: TextTokenizer, params: EmbedParams) -> tuple[int, str | None]:
    """The call's task adapter (its index in info.task_adapters; -1: the base weights) and the prompt name to
    tokenize with. `task`, or else a prompt_name that names a task, picks the adapter; the prompt of the
    task's name applies (as sentence-transformers' prompt_name=task) unless prompt_name names another."""
    task = params.task or None
    if task is None and params.prompt_name in info.task_adapters:
        task = params.prompt_name
    if task is None:
        return -1, params.prompt_name
    if not info.task_adapters:
        raise InvalidInput(f"model {info.name!r} has no task adapters; leave task unset")
    if task not in info.task_adapters:
        raise InvalidInput(f"unknown task {task!r}; model {info.name!r} has the tasks: {', '.join(info.task_adapters)}")
    prompt_name = params.prompt_name or (task if task in tokenizer.prompts else None)
    return info.task_adapters.index(task), prompt_name


def top_k(values: np.ndarray, indices: np.ndarray, k: int | None) -> SparseVector:
    """The k largest values (all when k is None), indices ascending; ties keep the smaller index."""
    if k is not None and len(values) > k:
        chosen = np.sort(np.argsort(-values, kind="stable")[:k])
        values, indices = values[chosen], indices[chosen]
    return SparseVector(indices=np.asarray(indices, dtype=np.int64), values=np.asarray(values, dtype=np.float32))


def assemble(
    outputs: list[SequenceOutput],
    encoded: list[InputSequence],
    params: EmbedParams,
    rules: TokenRules,
    prompt_tokens: int,
    timing: Timing,
) -> EmbedResult:
    """Each output the call asked for, in input order."""
    result = EmbedResult(embeddings=None, prompt_tokens=prompt_tokens, timing=timing)
    if EmbedOutput.DENSE in params.outputs:
        rows = stack_rows(outputs)
        result.embeddings = finish_embeddings(rows, params.dimensions, params.normalize)
    if EmbedOutput.SPARSE in params.outputs:
        result.sparse = [top_k(*output.sparse, params.sparse_top_k) for output in outputs]
    if EmbedOutput.MULTI_VECTOR in params.outputs:
        result.multi_vectors = [
            np.ascontiguousarray(output.vectors[rules.keep(e, params)], dtype=np.float32)
            for output, e in zip(outputs, encoded, strict=True)
        ]
    return result
