"""The embedserv.v1.Inference servicer: request validation, engine calls, response building (messages.py)."""

from __future__ import annotations

import time

import grpc

from embedserv import metrics
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.calls import Call, priority_field, stream_call, unary_call
from embedserv.server.frontend import Frontend
from embedserv.server.grpc.messages import (
    call_summary,
    direction,
    embed_params,
    embed_response,
    generate_response,
    input_items,
    model_info,
    multi_vector_message,
    rerank_chunking,
    rerank_inputs,
    sampling_params,
    server_limits,
    sparse_message,
    token_classifications,
    token_classify_params,
    truncate_of,
)
from embedserv.server.grpc.streams import answer_in_order
from embedserv.types import ClassifyParams, EmbedOutput, EmbedParams, ImageInput, Modality, RerankParams
from embedserv.v1 import embedserv_pb2 as pb
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc


class InferenceServicer(pb_grpc.InferenceServicer):
    rpc_prefix = ""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.active_calls = frontend.active_calls

    def _engine(self, name: str, call: Call) -> Engine:
        engine = self.frontend.models.get(name)
        call.model = engine.info.name
        return engine

    async def _embed(self, request: pb.EmbedRequest, call: Call) -> pb.EmbedResponse:
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        items = input_items(request)
        if items is None:
            inputs = self.frontend.check_inputs(request.inputs)
        else:
            inputs = self.frontend.check_items(engine, items, "items")
        params = embed_params(request)
        with self.frontend.limiter.hold(len(inputs)):
            result = await engine.embedding.embed(inputs, params)
        call.answered(len(inputs), result.prompt_tokens, result.timing)
        return embed_response(result, request.encoding, engine.info.name, received)

    @unary_call
    async def Embed(self, request, context, call):
        return await self._embed(request, call)

    @stream_call
    async def EmbedStream(self, request_iterator, context, call):
        # Requests start as they arrive (up to the window) and are answered in arrival order; each its own task,
        # so a message's priority field is its own.
        async def embed(request):
            priority_field(request)
            return await self._embed(request, call)

        async for response in answer_in_order(request_iterator, embed):
            yield response

    @unary_call
    async def EmbedSparse(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        params = EmbedParams(
            truncate=truncate_of(request),
            truncation_direction=direction(request.truncation_direction),
            prompt_name=request.prompt_name or None,
            outputs=(EmbedOutput.SPARSE,),
            sparse_top_k=request.top_k if request.HasField("top_k") else None,
        )
        with self.frontend.limiter.hold(len(texts)):
            result = await engine.embedding.embed(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        return pb.EmbedSparseResponse(
            embeddings=[sparse_message(v) for v in result.sparse],
            **call_summary(result.prompt_tokens, result.timing, engine.info.name, received),
        )

    @unary_call
    async def EmbedMultiVector(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        images = [ImageInput(data) for data in request.images]
        texts = list(request.inputs)
        if not texts and not images:
            raise InvalidInput("inputs and images are both empty; send at least one text or image")
        self.frontend.check_batch(len(texts) + len(images), "inputs and images")
        for index, text in enumerate(texts):
            self.frontend.check_chars(text, f"inputs[{index}]")
        self.frontend.check_images(engine, images, first_index=len(texts))
        params = EmbedParams(
            truncate=truncate_of(request), prompt_name=request.prompt_name or None, outputs=(EmbedOutput.MULTI_VECTOR,)
        )
        with self.frontend.limiter.hold(len(texts) + len(images)):
            result = await engine.embedding.embed(texts + images, params)
        call.answered(len(texts) + len(images), result.prompt_tokens, result.timing)
        return pb.EmbedMultiVectorResponse(
            embeddings=[multi_vector_message(v) for v in result.multi_vectors],
            **call_summary(result.prompt_tokens, result.timing, engine.info.name, received),
        )

    @unary_call
    async def Tokenize(self, request, context, call):
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        with self.frontend.limiter.hold(len(texts)):
            tokenized = await engine.tokens.tokenize(texts, add_special, request.prompt_name or None)
        call.answered(len(texts), sum(len(x.ids) for x in tokenized))
        inputs = [
            pb.TokenizedInput(
                tokens=[
                    pb.Token(id=i, text=t, start=o[0], end=o[1], special=s)
                    for i, t, o, s in zip(x.ids, x.tokens, x.offsets, x.special, strict=True)
                ]
            )
            for x in tokenized
        ]
        return pb.TokenizeResponse(inputs=inputs, model=engine.info.name)

    @unary_call
    async def ListModels(self, request, context, call):
        served = self.frontend.models
        # Each --lora adapter after its base, as a model of its own (base_model set; it shares the KV cache).
        models = [
            model_info(engine.info, usage, _image_limits(engine))
            for base in served.engines
            for engine, usage in ((base, base.core.status().kv_cache), *((a, None) for a in served.lora_engines(base)))
        ]
        limits = server_limits(self.frontend.config, self.frontend.receive_limit)
        return pb.ListModelsResponse(models=models, limits=limits)

    @unary_call
    async def Rerank(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        query, documents, field = rerank_inputs(request)
        self.frontend.check_rerank(engine, query, documents, field)
        self.frontend.check_chars(request.instruction, "instruction")
        params = RerankParams(
            top_n=request.top_n if request.HasField("top_n") else None,
            raw_scores=request.raw_scores,
            truncate=truncate_of(request),
            instruction=request.instruction or None,
            chunking=rerank_chunking(request.chunking),
        )
        with self.frontend.limiter.hold(len(documents)):
            result = await engine.reranking.rerank(query, documents, params)
        call.answered(len(documents), result.prompt_tokens, result.timing)
        results = [
            pb.RerankResult(index=r.index, score=r.score, document=_echo(documents[r.index], request.return_documents))
            for r in result.results
        ]
        summary = call_summary(result.prompt_tokens, result.timing, engine.info.name, received)
        return pb.RerankResponse(results=results, **summary)

    @unary_call
    async def Classify(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        sequences = self.frontend.check_candidate_labels(
            list(request.candidate_labels), request.hypothesis_template, len(texts)
        )
        params = ClassifyParams(
            truncate=truncate_of(request),
            truncation_direction=direction(request.truncation_direction),
            raw_scores=request.raw_scores,
            candidate_labels=tuple(request.candidate_labels),
            hypothesis_template=request.hypothesis_template,
            multi_label=request.multi_label,
        )
        with self.frontend.limiter.hold(sequences):
            result = await engine.classification.classify(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        classifications = [
            pb.Classification(
                scores=[
                    pb.LabelScore(label=label, score=score) for label, score in zip(result.labels, row, strict=True)
                ],
                label=result.labels[best],
                score=row[best],
            )
            for row, best in zip(result.scores.tolist(), result.scores.argmax(axis=1).tolist(), strict=True)
        ]
        summary = call_summary(result.prompt_tokens, result.timing, engine.info.name, received)
        return pb.ClassifyResponse(classifications=classifications, **summary)

    @unary_call
    async def ClassifyTokens(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        params = token_classify_params(request)
        with self.frontend.limiter.hold(len(texts)):
            result = await engine.token_classification.classify_tokens(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        return pb.ClassifyTokensResponse(
            inputs=token_classifications(result, request.all_scores),
            **call_summary(result.prompt_tokens, result.timing, engine.info.name, received),
        )

    @stream_call
    async def Generate(self, request, context, call):
        engine = self._engine(request.model, call)
        self.frontend.check_chars(request.prompt, "prompt")
        self.frontend.check_chars(request.decoder_prompt, "decoder_prompt")
        params = sampling_params(request)
        with self.frontend.limiter.hold(1):
            async for delta in engine.core.generate(request.prompt, params, decoder_prompt=request.decoder_prompt):
                if delta.finish_reason is not None:
                    call.answered(1, delta.prompt_tokens)
                    metrics.GENERATED_TOKENS.labels(call.model).inc(delta.completion_tokens)
                yield generate_response(delta)


def _echo(document: str | ImageInput, return_documents: bool) -> str:
    """A result's document text when the call asks for it; images are never echoed (the caller has them)."""
    return document if return_documents and isinstance(document, str) else ""


def _image_limits(engine: Engine) -> tuple[int, int]:
    if Modality.IMAGE not in engine.info.modalities:
        return 0, 0
    return engine.config.max_image_bytes, engine.config.max_image_pixels


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> str:
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    return pb.DESCRIPTOR.services_by_name["Inference"].full_name
