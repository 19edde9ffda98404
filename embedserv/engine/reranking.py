"""Rerank of whole documents: cross-encoders and yes/no rerankers score each (query, document) sequence with
their score head; embedding models score by the cosine of the query's and each document's embeddings.
(Late-interaction models rerank in multi_vector.py, chunked documents in chunking.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedserv.engine.outputs import activate, cosine_to_first, rank
from embedserv.engine.prefill import stack_rows
from embedserv.models.tasks import Seq2SeqYesNoTemplate
from embedserv.types import RankedDocument, RerankMode, RerankParams, RerankResult

if TYPE_CHECKING:
    from embedserv.engine.engine import Engine


async def rerank_whole(
    engine: Engine, query: str, documents: list[str], params: RerankParams, received: float
) -> RerankResult:
    """Documents scored against the query, best first; each document is one sequence (cut only with truncate)."""
    mode = engine.task.rerank_mode
    if mode is RerankMode.EMBEDDINGS:
        encoded = await engine.tokenize_with(engine.tokenizer.encode_for_cosine, query, documents, params.truncate)
    elif mode is RerankMode.PAIR:
        encoded = await engine.tokenize_with(engine.tokenizer.encode_pairs, query, documents, params.truncate)
    elif isinstance(engine.task.template, Seq2SeqYesNoTemplate):
        encoded = await engine.tokenize_with(
            engine.tokenizer.encode_seq2seq_template, engine.task.template, query, documents, params.truncate
        )
    else:
        instruction = params.instruction or engine.task.template.default_instruction
        encoded = await engine.tokenize_with(
            engine.tokenizer.encode_templated, engine.task.template, instruction, query, documents, params.truncate
        )
    outputs, prompt_tokens, timing = await engine.infer(encoded, received)
    rows = stack_rows(outputs)
    if mode is RerankMode.EMBEDDINGS:
        scores = cosine_to_first(rows)
    else:
        scores = rows[:, 0] if params.raw_scores else activate(rows, engine.task.rerank_activation)[:, 0]
    results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
    return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)
