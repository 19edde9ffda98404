"""text-embeddings-inference's HTTP API (router/src/http/server.rs): /embed, /embed_sparse, /embed_all,
/similarity, /predict, /tokenize, /decode, /info, /health, the root route (POST /: the model's own task) and
SageMaker's contract (POST /invocations, GET /ping), with TEI's fields, defaults and answers; TEI's /rerank is
served by scoring.py.

TEI serves one model and its bodies name none: each route takes the model the `x-embedserv-model` header
names, else the first served model that can do the route's task (/tokenize, /decode and /info: the first
served model). Errors come in TEI's shape, {"error", "error_type"}: 422 for an invalid body or input, 400
for an empty batch, 404 for an unknown model, 429 when overloaded, 503 when unhealthy.

Model choice and TEI semantics follow the TEI gRPC face (server/grpc/tei.py). Where we differ from TEI:
a pair in /predict is scored by a cross-encoder (the first one served, or the header's), not by any
classifier; /info's model_id is the served name; /rerank's and pairs' truncation_direction left is refused
when truncating (a document is cut from its end); /embed_sparse and /embed_all are served by models with the
sparse and multi-vector outputs (the first such, or the header's; a model without the output is refused
with what it serves named); /vertex is not served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

import embedserv
from embedserv.engine import checks
from embedserv.engine.engine import Engine
from embedserv.errors import NotReady
from embedserv.server.frontend import MODEL_HEADER
from embedserv.server.http.common import call_of, engine_for_task, engine_named, frontend_of, json_object, parsed
from embedserv.server.http.error_responses import JSON, TEI
from embedserv.server.http.scoring import inline_schema, score_pairs, tei_rerank
from embedserv.server.http.tei_models import (
    TeiDecodeRequest,
    TeiEmbedAllRequest,
    TeiEmbedRequest,
    TeiEmbedSparseRequest,
    TeiError,
    TeiInfo,
    TeiPrediction,
    TeiPredictRequest,
    TeiRank,
    TeiRerankRequest,
    TeiSimilarityParameters,
    TeiSimilarityRequest,
    TeiSparseValue,
    TeiToken,
    TeiTokenizeRequest,
    check_direction,
    embed_inputs,
    predict_sequences,
    require_some,
)
from embedserv.server.tei_semantics import model_kind, pair_scorer, tei_tokens
from embedserv.types import (
    ClassifyParams,
    EmbedOutput,
    EmbedParams,
    EmbedResult,
    ModelInfo,
    RerankParams,
    Task,
    Timing,
)

TEI_ERRORS = {"4XX": {"model": TeiError}, "5XX": {"model": TeiError}}
router = APIRouter(tags=["text-embeddings-inference"], responses=TEI_ERRORS)


def _model_engine(request: Request) -> Engine:
    """The header's model, else the first served model."""
    return engine_named(request, request.headers.get(MODEL_HEADER))


async def _embed_parts(
    request: Request, task: Task, body: TeiEmbedAllRequest, params: EmbedParams
) -> tuple[int, list[tuple[list[int], EmbedResult]]]:
    """The inputs embedded by the header's model, else the first serving `task`: texts in one engine call,
    token-id lists (used as given) in another. Returns the number of inputs and (input positions, result)
    per call made."""
    engine = engine_for_task(request, task)
    frontend = frontend_of(request)
    inputs = embed_inputs(body.inputs)
    require_some(inputs, "inputs")
    frontend.check_batch(len(inputs))
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    ids = [(i, x) for i, x in enumerate(inputs) if not isinstance(x, str)]
    for index, text in texts:
        frontend.check_chars(text, f"inputs[{index}]")
    with frontend.limiter.hold(len(inputs)):
        calls = [engine.embedding.embed([x for _, x in texts], params)] if texts else []
        if ids:
            calls.append(engine.embedding.embed_token_ids([x for _, x in ids], params))
        results = await asyncio.gather(*calls)
    timing = Timing.longest([r.timing for r in results])
    call_of(request).answered(len(inputs), sum(r.prompt_tokens for r in results), timing)
    positions = [[index for index, _ in part] for part in (texts, ids) if part]
    return len(inputs), list(zip(positions, results, strict=True))


def _in_input_order(
    count: int, parts: list[tuple[list[int], EmbedResult]], pick: Callable[[EmbedResult], list]
) -> list:
    """Each input's item (`pick`: one result's items, in its inputs' order) at the input's position."""
    items: list = [None] * count
    for positions, result in parts:
        for index, item in zip(positions, pick(result), strict=True):
            items[index] = item
    return items


def _text_params(body: TeiEmbedAllRequest, output: EmbedOutput) -> EmbedParams:
    return EmbedParams(
        truncate=body.truncate,
        truncation_direction=body.truncation_direction,
        prompt_name=body.prompt_name,
        outputs=(output,),
    )


@router.post("/embed", response_model=list[list[float]])
async def embed(request: Request, body: TeiEmbedRequest):
    """Pooled embeddings, one per input, in input order. Token-id inputs are used as given."""
    params = EmbedParams(
        normalize=body.normalize,
        truncate=body.truncate,
        truncation_direction=body.truncation_direction,
        dimensions=body.dimensions,
        prompt_name=body.prompt_name,
    )
    count, parts = await _embed_parts(request, Task.EMBED, body, params)
    if len(parts) == 1:
        return JSON(np.ascontiguousarray(parts[0][1].embeddings))
    return JSON(_in_input_order(count, parts, lambda result: result.embeddings.tolist()))


@router.post("/embed_sparse", response_model=list[list[TeiSparseValue]])
async def embed_sparse(request: Request, body: TeiEmbedSparseRequest):
    """Sparse vectors over the vocabulary, one list of {index, value} per input (non-zero values, index
    ascending), as TEI's SPLADE models answer: the header's model, else the first with the sparse output."""
    count, parts = await _embed_parts(request, Task.EMBED_SPARSE, body, _text_params(body, EmbedOutput.SPARSE))

    def pick(result: EmbedResult) -> list:
        return [
            [{"index": i, "value": v} for i, v in zip(s.indices.tolist(), s.values.tolist(), strict=True)]
            for s in result.sparse
        ]

    return JSON(_in_input_order(count, parts, pick))


@router.post("/embed_all", response_model=list[list[list[float]]])
async def embed_all(request: Request, body: TeiEmbedAllRequest):
    """Token embeddings, one [tokens, dimension] list per input: the multi-vector output of the header's
    model, else of the first with it (an embedder's last hidden states, as TEI's /embed_all)."""
    params = _text_params(body, EmbedOutput.MULTI_VECTOR)
    count, parts = await _embed_parts(request, Task.EMBED_MULTI_VECTOR, body, params)
    return JSON(_in_input_order(count, parts, lambda result: result.multi_vectors))


@router.post("/similarity", response_model=list[float])
async def similarity(request: Request, body: TeiSimilarityRequest):
    """The cosine similarity of inputs.source_sentence to each of inputs.sentences, in their order: the
    source sentence and the sentences embedded in one call (normalized), as TEI batches them, by the
    header's model, else the first embedder."""
    parameters = body.parameters or TeiSimilarityParameters()
    require_some(body.inputs.sentences, "inputs.sentences")
    engine = engine_for_task(request, Task.EMBED)
    frontend = frontend_of(request)
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    # The source sentence counts against --max-client-batch-size, as TEI counts it.
    frontend.check_batch(len(texts), "inputs (source_sentence and sentences together)")
    frontend.check_chars(texts[0], "inputs.source_sentence")
    for index, text in enumerate(texts[1:]):
        frontend.check_chars(text, f"inputs.sentences[{index}]")
    params = EmbedParams(
        truncate=parameters.truncate,
        truncation_direction=parameters.truncation_direction,
        prompt_name=parameters.prompt_name,
    )
    with frontend.limiter.hold(len(texts)):
        result = await engine.embedding.embed(texts, params)
    call_of(request).answered(len(texts), result.prompt_tokens, result.timing)
    vectors = result.embeddings
    return JSON(vectors[1:] @ vectors[0])


def _pair_scorer(request: Request) -> Engine:
    engine = pair_scorer(frontend_of(request), request.headers.get(MODEL_HEADER), "header")
    call_of(request).model = engine.info.name
    return engine


async def _predict_pairs(engine: Engine, pairs: list[tuple[str, str]], body: TeiPredictRequest):
    truncate = checks.truncates(engine.info, body.truncate)
    check_direction(body.truncation_direction, truncate, "pairs")
    scores, tokens, timing = await score_pairs(
        engine, pairs, RerankParams(raw_scores=body.raw_scores, truncate=truncate)
    )
    return [[{"score": s, "label": engine.info.labels[0]}] for s in scores], tokens, timing


async def _predict_texts(engine: Engine, texts: list[str], body: TeiPredictRequest):
    params = ClassifyParams(
        truncate=body.truncate, truncation_direction=body.truncation_direction, raw_scores=body.raw_scores
    )
    result = await engine.classification.classify(texts, params)
    predictions = []
    for row in result.scores.tolist():
        ranked = sorted(zip(row, result.labels, strict=True), key=lambda x: x[0], reverse=True)
        predictions.append([{"score": score, "label": label} for score, label in ranked])
    return predictions, result.prompt_tokens, result.timing


@router.post("/predict", response_model=list[TeiPrediction] | list[list[TeiPrediction]])
async def predict(request: Request, body: TeiPredictRequest):
    """Every label's score, best first: for one input a list, for a batch a list per input. A single text
    is classified (the header's model, else the first classifier); a pair [a, b] is scored by a
    cross-encoder (the header's model, else the first cross-encoder), as /rerank scores it."""
    frontend = frontend_of(request)
    single, sequences = predict_sequences(body.inputs)
    require_some(sequences, "inputs")
    frontend.check_batch(len(sequences))
    for index, sequence in enumerate(sequences):
        for text in sequence:
            frontend.check_chars(text, f"inputs[{index}]")
    texts = [i for i, s in enumerate(sequences) if len(s) == 1]
    pairs = [i for i, s in enumerate(sequences) if len(s) == 2]
    classifier = engine_for_task(request, Task.CLASSIFY) if texts else None
    scorer = _pair_scorer(request) if pairs else None
    with frontend.limiter.hold(len(sequences)):
        calls = [_predict_texts(classifier, [sequences[i][0] for i in texts], body)] if texts else []
        if pairs:
            calls.append(_predict_pairs(scorer, [tuple(sequences[i]) for i in pairs], body))
        results = await asyncio.gather(*calls)
    timing = Timing.longest([timing for _, _, timing in results])
    call_of(request).answered(len(sequences), sum(tokens for _, tokens, _ in results), timing)
    predictions = [None] * len(sequences)
    for indices, (part, _, _) in zip([p for p in (texts, pairs) if p], results, strict=True):
        for index, prediction in zip(indices, part, strict=True):
            predictions[index] = prediction
    return JSON(predictions[0] if single else predictions)


@router.post("/tokenize", response_model=list[list[TeiToken]])
async def tokenize(request: Request, body: TeiTokenizeRequest):
    """Each input's tokens: id, the input's text it covers (the token itself when special), its offsets."""
    engine = _model_engine(request)
    frontend = frontend_of(request)
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    require_some(texts, "inputs")
    frontend.check_inputs(texts)
    with frontend.limiter.hold(len(texts)):
        tokenized = await engine.tokens.tokenize(texts, body.add_special_tokens, body.prompt_name)
    call_of(request).answered(len(texts), sum(len(x.ids) for x in tokenized))
    return JSON(
        [
            [token._asdict() for token in tei_tokens(engine, text, body.prompt_name, tokens)]
            for text, tokens in zip(texts, tokenized, strict=True)
        ]
    )


@router.post("/decode", response_model=list[str])
async def decode(request: Request, body: TeiDecodeRequest):
    """Token ids back to text, one string per id list."""
    engine = _model_engine(request)
    frontend = frontend_of(request)
    batch = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids
    frontend.check_batch(len(batch), "ids")
    with frontend.limiter.hold(len(batch)):
        texts = await asyncio.gather(*(engine.tokens.decode(ids, body.skip_special_tokens) for ids in batch))
    call_of(request).answered(len(batch), sum(len(ids) for ids in batch))
    return JSON(list(texts))


def _model_type(info: ModelInfo) -> dict:
    """TEI's model_type object for the model's kind (tei_semantics.model_kind)."""
    kind = model_kind(info)
    if kind == "embedding":
        return {"embedding": {"pooling": info.pooling}}
    labels = info.labels or ("LABEL_0",)
    return {
        kind: {"id2label": {str(i): x for i, x in enumerate(labels)}, "label2id": {x: i for i, x in enumerate(labels)}}
    }


@router.get("/info", response_model=TeiInfo)
async def info(request: Request):
    """TEI's Info of the header's model, else of the first served model."""
    engine = _model_engine(request)
    config = frontend_of(request).config
    return JSON(
        {
            "model_id": engine.info.name,
            "model_sha": None,
            "model_dtype": engine.info.dtype,
            "served_model_name": engine.info.name,
            "model_type": _model_type(engine.info),
            "max_concurrent_requests": config.max_concurrent_requests,
            "max_input_length": engine.info.max_input_tokens,
            "max_batch_tokens": engine.config.batch_token_budget,
            "max_batch_requests": engine.config.max_batch_requests,
            "max_client_batch_size": config.max_client_batch_size,
            "auto_truncate": engine.info.auto_truncate,
            "tokenization_workers": config.tokenizer_threads,
            "version": embedserv.__version__,
            "sha": None,
            "docker_label": None,
        }
    )


@router.post("/invocations")
@router.post(
    "/",
    response_model=list[list[float]] | list[list[TeiSparseValue]] | list[TeiPrediction] | list[list[TeiPrediction]]
    | list[TeiRank] | list[float],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"oneOf": [
                inline_schema(TeiEmbedRequest), inline_schema(TeiPredictRequest), inline_schema(TeiRerankRequest),
                inline_schema(TeiSimilarityRequest),
            ]}}},
        }
    },
)  # fmt: skip
async def root(request: Request):
    """TEI's root route, which huggingface_hub's InferenceClient and LangChain's HuggingFaceEndpointEmbeddings
    call: the task of the header's model, else of the first served model, as TEI serves its one model's: /embed
    for an embedder (/embed_sparse for a sparse-only one), /predict for a classifier, /rerank for a reranker; a
    body with `query` and `texts` is a rerank whatever the model (the header's, else the first reranker), and
    one whose `inputs` is an object is a /similarity (InferenceClient.sentence_similarity's body). SageMaker's
    POST /invocations is the same route."""
    request.state.error_style = TEI
    body = await json_object(request, "TEI's body for the model's task (inputs; query and texts for a reranker)")
    info = _model_engine(request).info
    kind = model_kind(info)
    # A rerank body reranks whatever the first model does (as TEI's vertex route tells bodies apart).
    if kind == "reranker" or ("query" in body and "texts" in body):
        return await tei_rerank(request, parsed(TeiRerankRequest, body))
    if isinstance(body.get("inputs"), dict):
        return await similarity(request, parsed(TeiSimilarityRequest, body))
    if kind == "classifier":
        return await predict(request, parsed(TeiPredictRequest, body))
    if Task.EMBED not in info.tasks and Task.EMBED_SPARSE in info.tasks:
        return await embed_sparse(request, parsed(TeiEmbedSparseRequest, body))
    return await embed(request, parsed(TeiEmbedRequest, body))


@router.get("/ping", response_class=Response)
@router.get("/", response_class=Response, include_in_schema=False)
@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "Every served model is serving"}, 503: {"model": TeiError}},
)
async def health(request: Request):
    """200 with an empty body when every served model is serving and the server is not draining; else 503.
    Also GET / (TEI's Inference API health) and GET /ping (SageMaker's)."""
    frontend = frontend_of(request)
    if frontend.draining:
        raise NotReady("unhealthy: the server is shutting down")
    engines = frontend.models.engines
    waiting = [n for n in frontend.models.names if n not in {e.info.name for e in engines if e.core.status().serving}]
    if waiting:
        raise NotReady(f"unhealthy: not serving yet: {', '.join(waiting)}")
    return Response(status_code=200)
