"""Embed's host side: how a model's inputs are tokenized per output, and how each sequence's step outputs
become the dense, sparse and multi-vector results a call returns.

A model's `TokenRules` decide what is model-specific about token vectors: which tokens' vectors are
returned (all of them for last hidden states, all but the first for bge-m3's colbert head, the
MultiVectorEncoder's masks for its models) and, for late-interaction models, how queries and documents are
tokenized (engine/multi_vector.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from embedserv.engine.outputs import finish_embeddings
from embedserv.engine.prefill import SequenceOutput, stack_rows
from embedserv.engine.tokenizer import Encoded, TextTokenizer
from embedserv.types import EmbedOutput, EmbedParams, EmbedResult, SparseVector, Timing

if TYPE_CHECKING:
    from embedserv.engine.loading import ServedModel


class TokenRules:
    """Token vectors are the vectors of every token; inputs are tokenized as for Embed."""

    # Leading tokens whose vectors are left out (bge-m3's colbert head skips the CLS token).
    skip_first = 0

    def encode(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[Encoded]:
        return tokenizer.encode_batch(texts, params.truncate, params.truncation_direction, params.prompt_name)

    def keep(self, encoded: Encoded, params: EmbedParams) -> np.ndarray | slice:
        """Which of the sequence's token vectors the caller gets: a boolean mask or a slice."""
        return slice(self.skip_first, None)


class SkipFirstToken(TokenRules):
    skip_first = 1


def token_rules(served: ServedModel) -> TokenRules:
    spec = served.spec
    if spec.outputs.multi_vector == "bge_m3":
        return SkipFirstToken()
    if spec.outputs.multi_vector == "multi_vector_encoder":
        from embedserv.engine.multi_vector import MultiVectorRules
        from embedserv.models.multi_vector import read_multi_vector_settings

        settings = read_multi_vector_settings(spec.model_dir, spec.st, spec.hf_config.hidden_size)
        return MultiVectorRules(served.tokenizer, settings, spec.max_model_len, str(spec.model_dir))
    return TokenRules()


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
