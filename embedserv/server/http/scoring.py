"""Rerank, classify and score over HTTP, in the shapes their clients already parse.

- POST /v1/rerank: Cohere's, Jina's and vLLM's rerank: `query` + `documents` (texts or {"text"} objects),
  `top_n`, `return_documents` -> {id, model, results: [{index, relevance_score, document?}], usage}, best
  first. Documents are echoed by default, as Jina and vLLM do (Cohere's v1 default is off and v2 has no
  such field: Cohere clients ignore the extra `document`, or send return_documents=false). For models that take
  images, a document (or, for Qwen3-VL rerankers, the query) may be vLLM's multimodal form, {"content": [parts]}:
  an image_url part (a data URL), then a text part if any (image_inputs.content_item); images are never echoed. An extra
  `chunking: "max"` (here and on TEI's body) scores a document too long to fit beside the query by its best
  window of the model's limit instead of cutting or refusing it.
- POST /rerank: the same, or TEI's rerank when the body has `texts` instead of `documents` (TEI's body,
  answer and error shape, tei.py's module docstring). The body decides, since both APIs own the path.
- POST /v1/classify: vLLM's classify (what vLLM's and SGLang's docs show): `input` -> {id, object: list,
  created, model, data: [{index, label, probs, num_classes}], usage}.
- POST /v1/score: vLLM's score: `text_1` against `text_2`, one against many (1:N) or pairwise (N:N) ->
  data [{index, object: score, score}] in pair order. Cross-encoders score each pair; embedders give the
  cosine of the two texts' embeddings (Rerank by cosine, the same numbers).

All answer errors in OpenAI's shape ({"error": {message, type, param, code}}): 400 for a bad body.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request

from embedserv.engine import checks
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.http.common import call_of, engine_for_task, frontend_of, json_object, parsed
from embedserv.server.http.error_responses import JSON, OPENAI, TEI
from embedserv.server.http.image_inputs import content_item
from embedserv.server.http.scoring_models import (
    ClassifyRequest,
    ClassifyResponse,
    OpenAIError,
    RerankContent,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from embedserv.server.http.tei_models import TeiError, TeiRank, TeiRerankRequest, check_direction, require_some
from embedserv.types import ClassifyParams, EmbedInput, RerankParams, RerankResult, Task, Timing

OPENAI_ERRORS = {"4XX": {"model": OpenAIError}, "5XX": {"model": OpenAIError}}
router = APIRouter(tags=["rerank, classify, score"], responses=OPENAI_ERRORS)


def inline_schema(model: type[BaseModel]) -> dict:
    """A model's JSON schema with its nested models written in place, for a hand-made OpenAPI body."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(x) for x in node]
        return node

    return resolve(schema)


def usage(prompt_tokens: int, completion: bool = False) -> dict:
    extra = {"completion_tokens": 0} if completion else {}
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, **extra}


def list_answer(request: Request, kind: str, model: str, data: list[dict], prompt_tokens: int) -> JSON:
    """vLLM's list answer: {id: `kind`-<request id>, object: list, created, model, data, usage}."""
    return JSON(
        {
            "id": f"{kind}-{call_of(request).request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": usage(prompt_tokens, completion=True),
        }
    )


async def rerank_documents(request: Request, engine: Engine, query: EmbedInput, documents: list, params: RerankParams):
    """engine.rerank under admission, counted on the request's Call; the query and documents are checked already
    (Frontend.check_rerank)."""
    frontend = frontend_of(request)
    with frontend.limiter.hold(len(documents)):
        result = await engine.reranking.rerank(query, documents, params)
    call_of(request).answered(len(documents), result.prompt_tokens, result.timing)
    return result


async def score_pairs(
    engine: Engine, pairs: list[tuple[str, str]], params: RerankParams
) -> tuple[list[float], int, Timing]:
    """Each (first, second) pair's score, in pair order: one Rerank per distinct first text, all at once (the
    engine batches them). Admission and counting are the caller's."""
    groups: dict[str, list[int]] = {}
    for index, (first, _) in enumerate(pairs):
        if not first:
            raise InvalidInput(f"the first text of pair {index} is empty; send the text to score against")
        groups.setdefault(first, []).append(index)
    results: list[RerankResult] = await asyncio.gather(
        *(engine.reranking.rerank(first, [pairs[i][1] for i in indices], params) for first, indices in groups.items())
    )
    scores = [0.0] * len(pairs)
    for indices, result in zip(groups.values(), results, strict=True):
        for ranked in result.results:
            scores[indices[ranked.index]] = ranked.score
    return scores, sum(r.prompt_tokens for r in results), Timing.longest([r.timing for r in results])


def _rerank_item(value: str | RerankDocument | RerankContent, what: str) -> EmbedInput:
    if isinstance(value, str):
        return value
    if isinstance(value, RerankDocument):
        return value.text
    return content_item(value.content, what)


async def _documents_rerank(request: Request, body: RerankRequest) -> JSON:
    engine = engine_for_task(request, Task.RERANK, body.model)
    query = _rerank_item(body.query, "query")
    documents = [_rerank_item(d, f"documents[{index}]") for index, d in enumerate(body.documents)]
    frontend_of(request).check_rerank(engine, query, documents)
    params = RerankParams(
        top_n=body.top_n or None,
        raw_scores=body.raw_scores,
        truncate=body.truncate,
        instruction=body.instruction,
        chunking=body.chunking == "max",
    )
    result = await rerank_documents(request, engine, query, documents, params)
    results = []
    for ranked in result.results:
        item = {"index": ranked.index, "relevance_score": ranked.score}
        if body.return_documents and isinstance(documents[ranked.index], str):
            item["document"] = {"text": documents[ranked.index]}
        results.append(item)
    return JSON(
        {
            "id": f"rerank-{call_of(request).request_id}",
            "model": engine.info.name,
            "results": results,
            "usage": usage(result.prompt_tokens),
        }
    )


async def tei_rerank(request: Request, body: TeiRerankRequest) -> JSON:
    engine = engine_for_task(request, Task.RERANK)
    require_some(body.texts, "texts")
    frontend_of(request).check_rerank(engine, body.query, body.texts, "texts")
    truncate = checks.truncates(engine.info, body.truncate)
    check_direction(body.truncation_direction, truncate, "rerank")
    params = RerankParams(raw_scores=body.raw_scores, truncate=truncate, chunking=body.chunking == "max")
    result = await rerank_documents(request, engine, body.query, body.texts, params)
    ranks = []
    for ranked in result.results:
        rank = {"index": ranked.index, "score": ranked.score}
        if body.return_text:
            rank["text"] = body.texts[ranked.index]
        ranks.append(rank)
    return JSON(ranks)


@router.post("/v1/rerank", response_model=RerankResponse)
async def rerank(request: Request, body: RerankRequest):
    """Cohere / Jina / vLLM rerank: documents scored against the query, best first."""
    return await _documents_rerank(request, body)


_SHARED_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"oneOf": [inline_schema(RerankRequest), inline_schema(TeiRerankRequest)]}}
        },
    }
}
_SHARED_ERRORS = {"4XX": {"model": OpenAIError | TeiError}, "5XX": {"model": OpenAIError | TeiError}}


@router.post(
    "/rerank",
    response_model=RerankResponse | list[TeiRank],
    responses=_SHARED_ERRORS,
    openapi_extra=_SHARED_BODY,
)
async def rerank_shared(request: Request):
    """Cohere / Jina / vLLM rerank (a body with `documents`), or TEI's rerank (a body with `texts` and no
    `documents`: TEI's answer, a list of {index, score, text?} best first, and TEI's errors, 422 for a bad
    body)."""
    body = await json_object(request, "query and documents (Cohere, Jina, vLLM) or query and texts (TEI)")
    if "texts" in body and "documents" not in body:
        request.state.error_style = TEI
        return await tei_rerank(request, parsed(TeiRerankRequest, body))
    request.state.error_style = OPENAI
    return await _documents_rerank(request, parsed(RerankRequest, body))


@router.post("/v1/classify", response_model=ClassifyResponse)
async def classify(request: Request, body: ClassifyRequest):
    """vLLM's classify: every label's probability per input, and the best label."""
    engine = engine_for_task(request, Task.CLASSIFY, body.model)
    frontend = frontend_of(request)
    texts = frontend.check_inputs([body.input] if isinstance(body.input, str) else body.input, "input")
    with frontend.limiter.hold(len(texts)):
        params = ClassifyParams(truncate=body.truncate, raw_scores=body.raw_scores)
        result = await engine.classification.classify(texts, params)
    call_of(request).answered(len(texts), result.prompt_tokens, result.timing)
    labels = result.labels
    data = [
        {"index": index, "label": labels[best], "probs": row, "num_classes": len(labels)}
        for index, (row, best) in enumerate(
            zip(result.scores.tolist(), result.scores.argmax(axis=1).tolist(), strict=True)
        )
    ]
    return list_answer(request, "classify", engine.info.name, data, result.prompt_tokens)


def _pairs(body: ScoreRequest) -> list[tuple[str, str]]:
    """vLLM's rule: one text_1 against every text_2 (1:N), or as many of each, pairwise (N:N)."""
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise InvalidInput("text_1 and text_2 need at least one text each")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidInput(
            f"text_1 has {len(first)} texts and text_2 {len(second)}; send one text_1 to score against every "
            "text_2, or as many text_1 as text_2 to score them pairwise"
        )
    return list(zip(first, second, strict=True))


@router.post("/v1/score", response_model=ScoreResponse)
async def score(request: Request, body: ScoreRequest):
    """vLLM's score: a cross-encoder's score of each pair, or an embedder's cosine similarity."""
    engine = engine_for_task(request, Task.RERANK, body.model)
    frontend = frontend_of(request)
    pairs = _pairs(body)
    frontend.check_inputs([second for _, second in pairs], "text_2")
    for first in set(first for first, _ in pairs):
        frontend.check_chars(first, "text_1")
    with frontend.limiter.hold(len(pairs)):
        scores, tokens, timing = await score_pairs(
            engine, pairs, RerankParams(raw_scores=body.raw_scores, truncate=body.truncate)
        )
    call_of(request).answered(len(pairs), tokens, timing)
    data = [{"index": index, "object": "score", "score": value} for index, value in enumerate(scores)]
    return list_answer(request, "score", engine.info.name, data, tokens)
