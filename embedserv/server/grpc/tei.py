"""Hugging Face text-embeddings-inference's gRPC API (package tei.v1) on our gRPC port, so that clients
built for TEI work against embedserv unchanged.

TEI serves one model and its messages name none; we serve several, so a call picks its model with the
`x-embedserv-model` metadata key, else gets the first served model that can do the call's task (Info,
Tokenize and Decode: the first served model). Each unary RPC answers one text; a stream answers its
requests in order but runs up to a window of them at once, so that they batch on the engine.

EmbedSparse and EmbedAll are answered by models with the sparse and multi-vector outputs (the first such, or
the metadata's model; a model without the output is refused with INVALID_ARGUMENT naming what it serves).
Where TEI would do something embedserv cannot, the call is refused with a message that says what is
supported, never answered differently: LEFT truncation of rerank documents and text pairs (we cut a
document from its end, beside a whole query), and pairs for models that are not cross-encoders.
"""

from __future__ import annotations

import asyncio

import grpc

import embedserv
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.calls import Call, metadata_value, stream_call, unary_call
from embedserv.server.frontend import MODEL_HEADER, Frontend
from embedserv.server.grpc.streams import answer_in_order
from embedserv.server.tei_semantics import model_kind, pair_scorer, tei_tokens
from embedserv.tei.v1 import tei_pb2 as pb
from embedserv.tei.v1 import tei_pb2_grpc as pb_grpc
from embedserv.types import (
    ClassifyParams,
    EmbedOutput,
    EmbedParams,
    RerankParams,
    RerankResult,
    Task,
    Timing,
    TruncationDirection,
)

_DIRECTIONS = {
    pb.TRUNCATION_DIRECTION_RIGHT: TruncationDirection.RIGHT,
    pb.TRUNCATION_DIRECTION_LEFT: TruncationDirection.LEFT,
}


_OUTPUT_TASKS = {EmbedOutput.SPARSE: Task.EMBED_SPARSE, EmbedOutput.MULTI_VECTOR: Task.EMBED_MULTI_VECTOR}


def direction(value: int) -> TruncationDirection:
    if value not in _DIRECTIONS:
        raise InvalidInput(f"unknown truncation_direction {value}; use TRUNCATION_DIRECTION_RIGHT or _LEFT")
    return _DIRECTIONS[value]


def right_only(value: int, rpc: str) -> None:
    """Rerank and text pairs cut only the document (the second text), from its end, keeping the query whole."""
    if direction(value) is TruncationDirection.LEFT:
        raise InvalidInput(
            f"{rpc} cannot truncate from the left: embedserv cuts a too-long document (the second text) from its "
            "end and keeps the query whole; send TRUNCATION_DIRECTION_RIGHT (the default)"
        )


def metadata(chars: int, tokens: int, timing: Timing) -> pb.Metadata:
    return pb.Metadata(
        compute_chars=chars,
        compute_tokens=tokens,
        total_time_ns=timing.total_us * 1000,
        tokenization_time_ns=timing.tokenization_us * 1000,
        queue_time_ns=timing.queue_us * 1000,
        inference_time_ns=timing.inference_us * 1000,
    )


_MODEL_TYPES = {
    "reranker": pb.MODEL_TYPE_RERANKER,
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "embedding": pb.MODEL_TYPE_EMBEDDING,
}


def _ranks(result: RerankResult, indices: list[int], texts: list[str], return_text: bool) -> list[pb.Rank]:
    """Ranks of one engine.rerank call, by the request positions `indices` of its documents `texts`."""
    return [
        pb.Rank(index=indices[r.index], score=r.score, text=texts[r.index] if return_text else None)
        for r in result.results
    ]


def truncate_of(request) -> bool | None:
    """TEI's `truncate` is a plain proto3 bool: false is unset, as in TEI (the model's --auto-truncate decides)."""
    return request.truncate or None


class _TeiServicer:
    """What the five services share: the frontend, the calls in flight, the model choice, one text's checks."""

    rpc_prefix = "tei.v1."

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.active_calls = frontend.active_calls

    def _engine(self, context: grpc.aio.ServicerContext, call: Call, task: Task | None = None) -> Engine:
        """The model the metadata names, else the first served model (that serves `task`)."""
        name = metadata_value(context, MODEL_HEADER) or ""
        engine = self.frontend.engine_for(task, name) if task else self.frontend.models.get(name)
        call.model = engine.info.name
        return engine

    def _text(self, text: str, what: str = "inputs") -> str:
        if not text:
            raise InvalidInput(f"{what} is empty; send a text")
        self.frontend.check_chars(text, what)
        return text


class InfoServicer(_TeiServicer, pb_grpc.InfoServicer):
    @unary_call
    async def Info(self, request, context, call):
        engine = self._engine(context, call)
        info, config = engine.info, self.frontend.config
        return pb.InfoResponse(
            version=embedserv.__version__,
            model_id=info.name,
            model_dtype=info.dtype,
            model_type=_MODEL_TYPES[model_kind(info)],
            max_concurrent_requests=config.max_concurrent_requests,
            max_input_length=info.max_input_tokens,
            max_batch_tokens=engine.config.batch_token_budget,
            max_batch_requests=engine.config.max_batch_requests,
            max_client_batch_size=config.max_client_batch_size,
            tokenization_workers=config.tokenizer_threads,
        )


class EmbedServicer(_TeiServicer, pb_grpc.EmbedServicer):
    async def _embed(self, request: pb.EmbedRequest, context, call: Call) -> pb.EmbedResponse:
        engine = self._engine(context, call, Task.EMBED)
        text = self._text(request.inputs)
        params = EmbedParams(
            # TEI normalizes unless told not to.
            normalize=request.normalize if request.HasField("normalize") else True,
            truncate=truncate_of(request),
            truncation_direction=direction(request.truncation_direction),
            dimensions=request.dimensions if request.HasField("dimensions") else None,
            prompt_name=request.prompt_name or None,
        )
        with self.frontend.limiter.hold(1):
            result = await engine.embedding.embed([text], params)
        call.answered(1, result.prompt_tokens, result.timing)
        return pb.EmbedResponse(
            embeddings=result.embeddings[0].tolist(), metadata=metadata(len(text), result.prompt_tokens, result.timing)
        )

    @unary_call
    async def Embed(self, request, context, call):
        return await self._embed(request, context, call)

    @stream_call
    async def EmbedStream(self, request_iterator, context, call):
        async for response in answer_in_order(request_iterator, lambda r: self._embed(r, context, call)):
            yield response

    async def _output(self, request, context, call: Call, output: EmbedOutput):
        """One text's sparse vector (EmbedSparse: non-zero values, index ascending) or its token vectors
        (EmbedAll: the multi-vector output), from the metadata's model, else the first that gives it."""
        engine = self._engine(context, call, _OUTPUT_TASKS[output])
        text = self._text(request.inputs)
        params = EmbedParams(
            truncate=truncate_of(request),
            truncation_direction=direction(request.truncation_direction),
            prompt_name=request.prompt_name or None,
            outputs=(output,),
        )
        with self.frontend.limiter.hold(1):
            result = await engine.embedding.embed([text], params)
        call.answered(1, result.prompt_tokens, result.timing)
        meta = metadata(len(text), result.prompt_tokens, result.timing)
        if output is EmbedOutput.SPARSE:
            [vector] = result.sparse
            pairs = zip(vector.indices.tolist(), vector.values.tolist(), strict=True)
            values = [pb.SparseValue(index=i, value=v) for i, v in pairs]
            return pb.EmbedSparseResponse(sparse_embeddings=values, metadata=meta)
        [vectors] = result.multi_vectors
        tokens = [pb.TokenEmbedding(embeddings=row) for row in vectors.tolist()]
        return pb.EmbedAllResponse(token_embeddings=tokens, metadata=meta)

    @unary_call
    async def EmbedSparse(self, request, context, call):
        return await self._output(request, context, call, EmbedOutput.SPARSE)

    @stream_call
    async def EmbedSparseStream(self, request_iterator, context, call):
        sparse = EmbedOutput.SPARSE
        async for response in answer_in_order(request_iterator, lambda r: self._output(r, context, call, sparse)):
            yield response

    @unary_call
    async def EmbedAll(self, request, context, call):
        return await self._output(request, context, call, EmbedOutput.MULTI_VECTOR)

    @stream_call
    async def EmbedAllStream(self, request_iterator, context, call):
        vectors = EmbedOutput.MULTI_VECTOR
        async for response in answer_in_order(request_iterator, lambda r: self._output(r, context, call, vectors)):
            yield response


class PredictServicer(_TeiServicer, pb_grpc.PredictServicer):
    async def _classify(self, text: str, request, context, call: Call) -> pb.PredictResponse:
        """Every label's score for one text, best first (TEI's order)."""
        engine = self._engine(context, call, Task.CLASSIFY)
        text = self._text(text)
        params = ClassifyParams(
            truncate=truncate_of(request),
            truncation_direction=direction(request.truncation_direction),
            raw_scores=request.raw_scores,
        )
        with self.frontend.limiter.hold(1):
            result = await engine.classification.classify([text], params)
        call.answered(1, result.prompt_tokens, result.timing)
        scored = sorted(zip(result.scores[0].tolist(), result.labels, strict=True), key=lambda pair: -pair[0])
        return pb.PredictResponse(
            predictions=[pb.Prediction(score=score, label=label) for score, label in scored],
            metadata=metadata(len(text), result.prompt_tokens, result.timing),
        )

    def _pair_scorer(self, context, call: Call) -> Engine:
        engine = pair_scorer(self.frontend, metadata_value(context, MODEL_HEADER), "metadata key")
        call.model = engine.info.name
        return engine

    async def _predict_pair(self, request: pb.PredictPairRequest, context, call: Call) -> pb.PredictResponse:
        if len(request.inputs) == 1:
            return await self._classify(request.inputs[0], request, context, call)
        if len(request.inputs) != 2:
            raise InvalidInput(f"inputs must hold one text or a pair of two texts, not {len(request.inputs)}")
        engine = self._pair_scorer(context, call)
        first, second = (self._text(text, f"inputs[{i}]") for i, text in enumerate(request.inputs))
        right_only(request.truncation_direction, "PredictPair")
        with self.frontend.limiter.hold(1):
            params = RerankParams(raw_scores=request.raw_scores, truncate=truncate_of(request))
            result = await engine.reranking.rerank(first, [second], params)
        call.answered(1, result.prompt_tokens, result.timing)
        return pb.PredictResponse(
            predictions=[pb.Prediction(score=result.results[0].score, label=engine.info.labels[0])],
            metadata=metadata(len(first) + len(second), result.prompt_tokens, result.timing),
        )

    @unary_call
    async def Predict(self, request, context, call):
        return await self._classify(request.inputs, request, context, call)

    @unary_call
    async def PredictPair(self, request, context, call):
        return await self._predict_pair(request, context, call)

    @stream_call
    async def PredictStream(self, request_iterator, context, call):
        async for response in answer_in_order(request_iterator, lambda r: self._classify(r.inputs, r, context, call)):
            yield response

    @stream_call
    async def PredictPairStream(self, request_iterator, context, call):
        async for response in answer_in_order(request_iterator, lambda r: self._predict_pair(r, context, call)):
            yield response


class RerankServicer(_TeiServicer, pb_grpc.RerankServicer):
    @unary_call
    async def Rerank(self, request, context, call):
        engine = self._engine(context, call, Task.RERANK)
        texts = self.frontend.check_inputs(request.texts, "texts")
        self.frontend.check_chars(request.query, "query")
        right_only(request.truncation_direction, "Rerank")
        params = RerankParams(raw_scores=request.raw_scores, truncate=truncate_of(request))
        with self.frontend.limiter.hold(len(texts)):
            result = await engine.reranking.rerank(request.query, texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        chars = len(request.query) * len(texts) + sum(map(len, texts))
        return pb.RerankResponse(
            ranks=_ranks(result, list(range(len(texts))), texts, request.return_text),
            metadata=metadata(chars, result.prompt_tokens, result.timing),
        )

    @unary_call
    async def RerankStream(self, request_iterator, context, call):
        """All (query, text) requests ranked together in one answer; raw_scores and return_text come from the
        first request (as TEI's proto says), each request keeps its own query and truncate, as in TEI."""
        engine = self._engine(context, call, Task.RERANK)
        first = None
        # (query, truncate) -> the request positions and texts it ranks: one engine call each.
        groups: dict[tuple[str, bool], tuple[list[int], list[str]]] = {}
        count = chars = 0
        async for request in request_iterator:
            if first is None:
                first = request
            self.frontend.check_batch(count + 1, "requests in the stream")
            self.frontend.check_chars(request.query, f"request {count} query")
            self.frontend.check_chars(request.text, f"request {count} text")
            right_only(request.truncation_direction, "RerankStream")
            indices, texts = groups.setdefault((request.query, truncate_of(request)), ([], []))
            indices.append(count)
            texts.append(request.text)
            count += 1
            chars += len(request.query) + len(request.text)
        if first is None:
            raise InvalidInput("the stream carried no requests; send at least one (query, text) request")
        raw = first.raw_scores
        with self.frontend.limiter.hold(count):
            tasks = [
                asyncio.ensure_future(
                    engine.reranking.rerank(query, texts, RerankParams(raw_scores=raw, truncate=truncate))
                )
                for (query, truncate), (_, texts) in groups.items()
            ]
            try:
                results = await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # the first failure ends the call; the other groups stop too
                    task.cancel()
        ranks = [
            rank
            for ((indices, texts), result) in zip(groups.values(), results, strict=True)
            for rank in _ranks(result, indices, texts, first.return_text)
        ]
        # Best first across the groups; equal scores keep request order.
        ranks.sort(key=lambda rank: (-rank.score, rank.index))
        tokens = sum(r.prompt_tokens for r in results)
        timing = Timing.longest([r.timing for r in results])
        call.answered(count, tokens, timing)
        return pb.RerankResponse(ranks=ranks, metadata=metadata(chars, tokens, timing))


class TokenizeServicer(_TeiServicer, pb_grpc.TokenizeServicer):
    async def _tokenize(self, request: pb.EncodeRequest, context, call: Call) -> pb.EncodeResponse:
        engine = self._engine(context, call)
        text = self._text(request.inputs)
        prompt_name = request.prompt_name or None
        with self.frontend.limiter.hold(1):
            [tokenized] = await engine.tokens.tokenize([text], request.add_special_tokens, prompt_name)
        call.answered(1, len(tokenized.ids))
        tokens = tei_tokens(engine, text, prompt_name, tokenized)
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**token._asdict()) for token in tokens])

    async def _decode(self, request: pb.DecodeRequest, context, call: Call) -> pb.DecodeResponse:
        engine = self._engine(context, call)
        if not request.ids:
            raise InvalidInput("ids is empty; send at least one token id")
        with self.frontend.limiter.hold(1):
            text = await engine.tokens.decode(list(request.ids), request.skip_special_tokens)
        call.answered(1, len(request.ids))
        return pb.DecodeResponse(text=text)

    @unary_call
    async def Tokenize(self, request, context, call):
        return await self._tokenize(request, context, call)

    @stream_call
    async def TokenizeStream(self, request_iterator, context, call):
        async for response in answer_in_order(request_iterator, lambda r: self._tokenize(r, context, call)):
            yield response

    @unary_call
    async def Decode(self, request, context, call):
        return await self._decode(request, context, call)

    @stream_call
    async def DecodeStream(self, request_iterator, context, call):
        async for response in answer_in_order(request_iterator, lambda r: self._decode(r, context, call)):
            yield response


def add_tei_services(frontend: Frontend, server: grpc.aio.Server) -> list[str]:
    """Registers TEI's five services on `server`; returns their full names (for reflection)."""
    pb_grpc.add_InfoServicer_to_server(InfoServicer(frontend), server)
    pb_grpc.add_EmbedServicer_to_server(EmbedServicer(frontend), server)
    pb_grpc.add_PredictServicer_to_server(PredictServicer(frontend), server)
    pb_grpc.add_RerankServicer_to_server(RerankServicer(frontend), server)
    pb_grpc.add_TokenizeServicer_to_server(TokenizeServicer(frontend), server)
    return [service.full_name for service in pb.DESCRIPTOR.services_by_name.values()]
