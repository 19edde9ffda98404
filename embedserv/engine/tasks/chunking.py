"""Long inputs by windows: CHUNKING_MEAN for Embed, CHUNKING_MAX for Rerank.

An input longer than the model's limit is split, without overlap, into windows of as many of its tokens as
fit beside the model's special tokens (and the prompt, or the query), and every window of every input of
the call goes to the scheduler at once, so windows batch like any other sequences. An input that fits is
one window and gets exactly what the call without chunking gives.

- Embed: the mean of the windows' pooled vectors (after the model's Dense layers), weighted by each
  window's token count as the model sees it (special tokens and prompt included), then `dimensions` and
  normalization as usual. Usage counts every window's tokens. Any pooling works (CLS and last-token
  pooling average one state per window); only the dense output is averaged, so a model without one, or a
  call asking for others, is refused.
- Rerank: a cross-encoder scores the query with each window (the query is never split: one that leaves no
  room is refused), an embedding model the cosine of the query with each window's embedding; a document
  scores as its best window (after the activation, or raw with raw_scores). Yes/no and MaxSim rerankers
  refuse chunking.

`truncate` and `truncation_direction` do not apply: with chunking nothing is too long, so nothing is cut.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from embedserv.engine import checks
from embedserv.engine.inputs import pairs
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks.outputs import activate, cosine_to_first, finish_embeddings, rank, stack_rows
from embedserv.types import (
    EmbedParams,
    EmbedResult,
    RankedDocument,
    RerankMode,
    RerankParams,
    RerankResult,
)


async def embed_chunked(
    core: Core, served: ServedModel, texts: list[str], params: EmbedParams, received: float, adapter: int = -1
) -> EmbedResult:
    """Each text's embedding as the token-count-weighted mean of its windows' pooled vectors (weight: the
    window's length in tokens, special tokens and prompt included), then dimensions and normalization; float32
    (quantize.py applies the call's encoding after)."""
    checks.check_embed_chunking(served.info, params)
    windows = await core.tokenize_with(served.tokenizer.encode_windows, texts, params.prompt_name)
    flat = [replace(window, adapter=adapter) for text_windows in windows for window in text_windows]
    outputs, prompt_tokens, timing = await core.infer(flat, received, params.outputs, use_cache=not params.bypass_cache)
    rows = stack_rows(outputs)
    weights = np.array([len(window.ids) for window in flat], dtype=np.float64)
    means = weighted_means(rows, weights, [len(w) for w in windows])
    embeddings = finish_embeddings(means, params.dimensions, params.normalize)
    return EmbedResult(embeddings=embeddings, prompt_tokens=prompt_tokens, timing=timing)


async def rerank_chunked(
    core: Core, served: ServedModel, query: str, documents: list[str], params: RerankParams, received: float
) -> RerankResult:
    """Documents scored against the query by their best window, best first."""
    mode = served.task.rerank_mode
    checks.check_rerank_chunking(served.info, mode)
    tokenizer = served.tokenizer
    if mode is RerankMode.PAIR:
        windows = await core.tokenize_with(pairs.encode_pair_windows, tokenizer, query, documents)
        flat = [window for document_windows in windows for window in document_windows]
        outputs, prompt_tokens, timing = await core.infer(flat, received)
        logits = stack_rows(outputs)
        scores = logits[:, 0] if params.raw_scores else activate(logits, served.task.rerank_activation)[:, 0]
    else:
        encoded_query, windows = await core.tokenize_with(tokenizer.encode_cosine_windows, query, documents)
        flat = [window for document_windows in windows for window in document_windows]
        outputs, prompt_tokens, timing = await core.infer([encoded_query, *flat], received)
        scores = cosine_to_first(stack_rows(outputs))
    best = best_windows(scores, [len(w) for w in windows])
    results = [RankedDocument(index, score) for index, score in rank(best, params.top_n)]
    return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)


def _starts(counts: list[int]) -> np.ndarray:
    """Where each input's windows begin in the flat list (every input has at least one window)."""
    return np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64)


def weighted_means(rows: np.ndarray, weights: np.ndarray, counts: list[int]) -> np.ndarray:
    """[len(counts), dim] float32: each input's `counts[i]` consecutive rows averaged with `weights`.
    Computed in float64, where a float32 row times an integer weight and divided back is exact: an input
    of one window gets its row back bit for bit."""
    starts = _starts(counts)
    sums = np.add.reduceat(rows.astype(np.float64) * weights[:, None], starts, axis=0)
    return (sums / np.add.reduceat(weights, starts)[:, None]).astype(np.float32)


def best_windows(scores: np.ndarray, counts: list[int]) -> np.ndarray:
    """[len(counts)] float32: each document's best window score."""
    return np.maximum.reduceat(scores, _starts(counts)).astype(np.float32)
