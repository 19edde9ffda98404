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
from embedserv.engine.served_model import ServedModel
from embedserv.engine.ports import Infer, SequenceOutput, stack_rows
from embedserv.engine.inputs import image_inputs
from embedserv.engine.tasks import chunking, late_chunking
from embedserv.engine.tasks.multi_vector import MultiVectorRules
from embedserv.engine.tasks.outputs import finish_embeddings
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.tasks.vision_retrieval import VISION_RETRIEVAL, VisionRetrievalRules, read_retrieval_prompts
from embedserv.engine.inputs.tokenizer import Encoded
from embedserv.errors import InvalidInput
from embedserv.models import registry
from embedserv.types import EmbedOutput, EmbedParams, EmbedResult, ImageInput, SparseVector, Timing


def token_rules(served: ServedModel) -> TokenRules:
    """The rules of the model's head kind (models/registry.HEAD_KINDS), whose heads the worker runs."""
    spec = served.spec
    heads = registry.head_kind(spec.outputs.head_kind)
    if heads.token_settings is not None:
        return MultiVectorRules(served.tokenizer, heads.token_settings(spec), spec.max_model_len, str(spec.model_dir))
    if spec.outputs.head_kind == VISION_RETRIEVAL:
        prompts = read_retrieval_prompts(spec.model_dir, spec.info.architecture, spec.hf_config, served.tokenizer)
        return VisionRetrievalRules(served.tokenizer, prompts, served.vision)
    return TokenRules(skip_first=heads.skip_first_tokens, vision=served.vision)


class Embedding:
    """Embed and its token-id form, through the engine core's port; results in float32."""

    def __init__(self, infer: Infer, served: ServedModel, allow_pickle: bool = False) -> None:
        self._infer = infer
        self._served = served
        self.token_rules = token_rules(served)
        # Late chunking's copy of the model's Dense modules, read on its first call.
        self._dense = late_chunking.HostDense(served, allow_pickle)

    async def embed(self, texts: list[str | ImageInput], params: EmbedParams) -> EmbedResult:
        """The outputs `params.outputs` names (dense, sparse, token vectors) per input, from one forward pass;
        inputs are texts, or images for models that take them (image_inputs.py)."""
        received = time.perf_counter()
        tokenizer = self._served.tokenizer
        adapter, prompt_name = checks.task_adapter(self._served.info, tokenizer, params)
        params = replace(params, prompt_name=prompt_name)
        has_images = bool(image_inputs.image_indices(texts))
        if has_images or self._served.vision is not None:
            image_inputs.check_call(self._served, texts, params)
        checks.check_embed(self._served.info, tokenizer, texts, params)
        if has_images:
            encoded = await image_inputs.encode_inputs(self._infer, self._served, self.token_rules, texts, params)
            return await self._pooled(with_adapter(encoded, adapter), params, received)
        if params.late_chunking is not None:
            return await late_chunking.embed_late_chunks(
                self._infer, self._served, texts, params, received, self._dense, adapter
            )
        if params.chunking:
            return await chunking.embed_chunked(self._infer, self._served, texts, params, received, adapter)
        encoded = await self._infer.tokenize_with(
            self.token_rules.encode, tokenizer, texts, params, chars=sum(map(len, texts))
        )
        return await self._pooled(with_adapter(encoded, adapter), params, received)

    async def embed_token_ids(self, token_ids: list[list[int]], params: EmbedParams) -> EmbedResult:
        """Embeds pre-tokenized inputs, used as given (no prompt, no special tokens added)."""
        received = time.perf_counter()
        tokenizer = self._served.tokenizer
        checks.check_embed(self._served.info, tokenizer, token_ids, params)
        if params.prompt_name:
            raise InvalidInput("prompt_name applies to texts; token-id inputs are used as given")
        if params.late_chunking is not None:
            raise InvalidInput("late_chunking applies to texts (its spans are character offsets); send texts")
        # A task picks the adapter only: token ids get no prompt.
        adapter, _ = checks.task_adapter(self._served.info, tokenizer, params)
        encoded = await self._infer.tokenize_with(
            tokenizer.check_token_ids, token_ids, params.truncate, params.truncation_direction
        )
        self.token_rules.check_ids(encoded)
        # Padded as the model's texts are (SigLIP), which a caller's own tokenizer does not do.
        encoded = self.token_rules.pad_texts(encoded)
        return await self._pooled(with_adapter(encoded, adapter), params, received)

    async def _pooled(self, encoded: list[Encoded], params: EmbedParams, received: float) -> EmbedResult:
        outputs, prompt_tokens, timing = await self._infer.infer(
            encoded, received, params.outputs, use_cache=not params.bypass_cache
        )
        return assemble(outputs, encoded, params, self.token_rules, prompt_tokens, timing)


def with_adapter(encoded: list[Encoded], adapter: int) -> list[Encoded]:
    return encoded if adapter < 0 else [replace(e, adapter=adapter) for e in encoded]


def top_k(values: np.ndarray, indices: np.ndarray, k: int | None) -> SparseVector:
    """The k largest values (all when k is None), indices ascending; ties keep the smaller index."""
    if k is not None and len(values) > k:
        chosen = np.sort(np.argsort(-values, kind="stable")[:k])
        values, indices = values[chosen], indices[chosen]
    return SparseVector(indices=np.asarray(indices, dtype=np.int64), values=np.asarray(values, dtype=np.float32))


def assemble(
    outputs: list[SequenceOutput], encoded: list[Encoded], params: EmbedParams, rules: TokenRules,
    prompt_tokens: int, timing: Timing,
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
            for output, e in zip(outputs, encoded)
        ]
    return result
