"""The embedserv.v1.Inference servicer: request validation, engine calls, response building."""

from __future__ import annotations

import dataclasses
import time

import grpc
import numpy as np

from embedserv import metrics
from embedserv.config import ServerConfig
from embedserv.engine.engine import Engine
from embedserv.engine.tasks.outputs import to_little_endian_bytes
from embedserv.types import (
    ClassifyParams,
    EmbedOutput,
    EmbedParams,
    EmbedResult,
    Encoding,
    FinishReason,
    GenerationDelta,
    KvCacheUsage,
    ModelInfo,
    RerankParams,
    SamplingParams,
    SparseVector,
    Task,
    Timing,
    TruncationDirection,
)
from embedserv.errors import InvalidInput
from embedserv.server.calls import Call, stream_call, unary_call
from embedserv.server.frontend import Frontend
from embedserv.server.grpc.late_chunks import chunks_messages, late_chunking_params
from embedserv.server.grpc.streams import answer_in_order
from embedserv.v1 import embedserv_pb2 as pb
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

_DIRECTIONS = {
    pb.TRUNCATION_DIRECTION_RIGHT: TruncationDirection.RIGHT,
    pb.TRUNCATION_DIRECTION_LEFT: TruncationDirection.LEFT,
}
_TASKS = {
    Task.EMBED: pb.TASK_EMBED,
    Task.RERANK: pb.TASK_RERANK,
    Task.CLASSIFY: pb.TASK_CLASSIFY,
    Task.GENERATE: pb.TASK_GENERATE,
    Task.EMBED_SPARSE: pb.TASK_EMBED_SPARSE,
    Task.EMBED_MULTI_VECTOR: pb.TASK_EMBED_MULTI_VECTOR,
}
_OUTPUTS = {
    pb.OUTPUT_DENSE: EmbedOutput.DENSE,
    pb.OUTPUT_SPARSE: EmbedOutput.SPARSE,
    pb.OUTPUT_MULTI_VECTOR: EmbedOutput.MULTI_VECTOR,
}
_OUTPUT_ENUMS = {output: value for value, output in _OUTPUTS.items()}
# ENCODING_FLOAT and ENCODING_BYTES both compute float32; they differ only on the wire.
_ENCODINGS = {
    pb.ENCODING_FLOAT: Encoding.FLOAT32,
    pb.ENCODING_BYTES: Encoding.FLOAT32,
    pb.ENCODING_FLOAT16: Encoding.FLOAT16,
    pb.ENCODING_INT8: Encoding.INT8,
    pb.ENCODING_UINT8: Encoding.UINT8,
    pb.ENCODING_INT8_PER_DIMENSION: Encoding.INT8_PER_DIMENSION,
    pb.ENCODING_UINT8_PER_DIMENSION: Encoding.UINT8_PER_DIMENSION,
    pb.ENCODING_BINARY: Encoding.BINARY,
    pb.ENCODING_UBINARY: Encoding.UBINARY,
}
_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def embed_params(request: pb.EmbedRequest) -> EmbedParams:
    if request.encoding not in _ENCODINGS:
        names = ", ".join(pb.Encoding.Name(value) for value in _ENCODINGS)
        raise InvalidInput(f"unknown encoding {request.encoding}; use one of {names}")
    unknown = [value for value in request.outputs if value not in _OUTPUTS]
    if unknown:
        raise InvalidInput(f"unknown output {unknown[0]}; use OUTPUT_DENSE, OUTPUT_SPARSE or OUTPUT_MULTI_VECTOR")
    if request.chunking not in (pb.CHUNKING_NONE, pb.CHUNKING_MEAN):
        raise InvalidInput(f"Embed chunks with CHUNKING_MEAN (or CHUNKING_NONE), not {_chunking_name(request.chunking)}")
    return EmbedParams(
        normalize=request.normalize if request.HasField("normalize") else True,
        truncate=truncate_of(request),
        truncation_direction=_direction(request.truncation_direction),
        dimensions=request.dimensions if request.HasField("dimensions") else None,
        prompt_name=request.prompt_name or None,
        outputs=tuple(_OUTPUTS[value] for value in request.outputs) or (EmbedOutput.DENSE,),
        chunking=request.chunking == pb.CHUNKING_MEAN,
        sparse_top_k=request.sparse_top_k if request.HasField("sparse_top_k") else None,
        encoding=_ENCODINGS[request.encoding],
        task=request.task or None,
        late_chunking=late_chunking_params(request),
        bypass_cache=request.bypass_cache,
    )


def truncate_of(request) -> bool | None:
    """The call's `truncate`, or None when it leaves it unset (the model's --auto-truncate decides)."""
    return request.truncate if request.HasField("truncate") else None


def _chunking_name(value: int) -> str:
    try:
        return pb.Chunking.Name(value)
    except ValueError:
        return str(value)


def sparse_message(vector: SparseVector) -> pb.SparseEmbedding:
    return pb.SparseEmbedding(indices=vector.indices.tolist(), values=vector.values.tolist())


def multi_vector_message(vectors: np.ndarray) -> pb.MultiVector:
    rows, width = vectors.shape
    return pb.MultiVector(num_vectors=rows, dimension=width, raw=to_little_endian_bytes(vectors))


def _rerank_chunking(value: int) -> bool:
    if value not in (pb.CHUNKING_NONE, pb.CHUNKING_MAX):
        raise InvalidInput(f"Rerank chunks with CHUNKING_MAX (or CHUNKING_NONE), not {_chunking_name(value)}")
    return value == pb.CHUNKING_MAX


def timing_message(timing: Timing, received: float) -> pb.Timing:
    return pb.Timing(
        queue_us=timing.queue_us,
        tokenization_us=timing.tokenization_us,
        inference_us=timing.inference_us,
        total_us=int((time.perf_counter() - received) * 1e6),
    )


def _direction(value: int) -> TruncationDirection:
    if value not in _DIRECTIONS:
        raise InvalidInput(f"unknown truncation_direction {value}; use RIGHT or LEFT")
    return _DIRECTIONS[value]


def call_summary(prompt_tokens: int, timing: Timing, model: str, received: float) -> dict:
    """The usage, model and timing fields every unary response carries."""
    return dict(usage=pb.Usage(prompt_tokens=prompt_tokens), model=model, timing=timing_message(timing, received))


def embedding_messages(rows: np.ndarray, encoding: int) -> list[pb.Embedding]:
    if encoding == pb.ENCODING_FLOAT:
        return [pb.Embedding(values=row) for row in rows.tolist()]
    # Every other encoding: the row's bytes, little-endian (float32, float16; int8 / uint8 are bytes).
    rows = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
    return [pb.Embedding(raw=row.tobytes()) for row in rows]


def embed_response(result: EmbedResult, encoding: int, model: str, received: float) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=embedding_messages(result.embeddings, encoding) if result.embeddings is not None else [],
        chunks=chunks_messages(result, lambda rows: embedding_messages(rows, encoding)),
        sparse_embeddings=[sparse_message(v) for v in result.sparse] if result.sparse is not None else [],
        multi_vectors=[multi_vector_message(v) for v in result.multi_vectors] if result.multi_vectors is not None else [],
        encoding_scale=result.encoding_scale,
        **call_summary(result.prompt_tokens, result.timing, model, received),
    )


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    # proto3 cannot tell an unset top_p from 0: 0 means 1, as the proto says.
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p if request.top_p != 0 else 1.0,
        top_k=request.top_k,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        ignore_eos=request.ignore_eos,
    )


def generate_response(delta: GenerationDelta) -> pb.GenerateResponse:
    if delta.finish_reason is None:
        return pb.GenerateResponse(text=delta.text, token_ids=delta.token_ids)
    return pb.GenerateResponse(
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=_FINISH_REASONS[delta.finish_reason],
        usage=pb.Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens),
    )


def server_limits(config: ServerConfig) -> pb.ServerLimits:
    return pb.ServerLimits(
        max_client_batch_size=config.max_client_batch_size,
        max_input_chars=config.max_input_chars,
        max_concurrent_requests=config.max_concurrent_requests,
        max_receive_message_bytes=config.max_receive_message_bytes,
    )


def model_info(info: ModelInfo, kv_cache: KvCacheUsage | None = None) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        tasks=[_TASKS[t] for t in info.tasks],
        architecture=info.architecture,
        attention=pb.ATTENTION_KIND_CAUSAL if info.is_causal else pb.ATTENTION_KIND_BIDIRECTIONAL,
        pooling=info.pooling,
        dimension=info.dimension,
        max_input_tokens=info.max_input_tokens,
        prompt_names=list(info.prompt_names),
        adapters=list(info.adapters),
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
        labels=list(info.labels),
        is_encoder_decoder=info.is_encoder_decoder,
        kv_cache=pb.KvCache(**dataclasses.asdict(kv_cache)) if kv_cache is not None else None,
        kv_sharing=pb.KvSharing(
            shared_layers=[pb.KvSharing.SharedLayer(layer=a, source_layer=b) for a, b in info.kv_shared_layers],
            fast_prefill=info.kv_sharing_fast_prefill,
        ) if info.kv_shared_layers else None,
        outputs=[_OUTPUT_ENUMS[o] for o in info.outputs],
        sparse_dimension=info.sparse_dimension,
        multi_vector_dimension=info.multi_vector_dimension,
        base_model=info.base_model,
        lora_adapters=list(info.lora_adapters),
        auto_truncate=info.auto_truncate,
    )


class InferenceServicer(pb_grpc.InferenceServicer):
    rpc_prefix = ""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.active_calls = frontend.active_calls

    def _engine(self, name: str, call: Call) -> Engine:
        engine = self.frontend.engine(name)
        call.model = engine.info.name
        return engine

    async def _embed(self, request: pb.EmbedRequest, call: Call) -> pb.EmbedResponse:
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        params = embed_params(request)
        with self.frontend.hold(len(texts)):
            result = await engine.embed(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        return embed_response(result, request.encoding, engine.info.name, received)

    @unary_call
    async def Embed(self, request, context, call):
        return await self._embed(request, call)

    @stream_call
    async def EmbedStream(self, request_iterator, context, call):
        # Requests start as they arrive (up to the window) and are answered in arrival order.
        async for response in answer_in_order(request_iterator, lambda request: self._embed(request, call)):
            yield response

    @unary_call
    async def EmbedSparse(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        params = EmbedParams(
            truncate=truncate_of(request), truncation_direction=_direction(request.truncation_direction),
            prompt_name=request.prompt_name or None, outputs=(EmbedOutput.SPARSE,),
            sparse_top_k=request.top_k if request.HasField("top_k") else None,
        )
        with self.frontend.hold(len(texts)):
            result = await engine.embed(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        return pb.EmbedSparseResponse(
            embeddings=[sparse_message(v) for v in result.sparse],
            **call_summary(result.prompt_tokens, result.timing, engine.info.name, received),
        )

    @unary_call
    async def EmbedMultiVector(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        params = EmbedParams(
            truncate=truncate_of(request), prompt_name=request.prompt_name or None, outputs=(EmbedOutput.MULTI_VECTOR,)
        )
        with self.frontend.hold(len(texts)):
            result = await engine.embed(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        return pb.EmbedMultiVectorResponse(
            embeddings=[multi_vector_message(v) for v in result.multi_vectors],
            **call_summary(result.prompt_tokens, result.timing, engine.info.name, received),
        )

    @unary_call
    async def Tokenize(self, request, context, call):
        engine = self._engine(request.model, call)
        texts = self.frontend.check_inputs(request.inputs)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        with self.frontend.hold(len(texts)):
            tokenized = await engine.tokenize(texts, add_special, request.prompt_name or None)
        call.answered(len(texts), sum(len(x.ids) for x in tokenized))
        inputs = [
            pb.TokenizedInput(
                tokens=[
                    pb.Token(id=i, text=t, start=o[0], end=o[1], special=s)
                    for i, t, o, s in zip(x.ids, x.tokens, x.offsets, x.special)
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
            model_info(engine.info, usage)
            for base in served.engines
            for engine, usage in ((base, base.kv_cache_usage()), *((a, None) for a in served.adapter_engines(base)))
        ]
        return pb.ListModelsResponse(models=models, limits=server_limits(self.frontend.config))

    @unary_call
    async def Rerank(self, request, context, call):
        received = time.perf_counter()
        engine = self._engine(request.model, call)
        documents = self.frontend.check_inputs(request.documents, "documents")
        self.frontend.check_chars(request.query, "query")
        self.frontend.check_chars(request.instruction, "instruction")
        params = RerankParams(
            top_n=request.top_n if request.HasField("top_n") else None,
            raw_scores=request.raw_scores,
            truncate=truncate_of(request),
            instruction=request.instruction or None,
            chunking=_rerank_chunking(request.chunking),
        )
        with self.frontend.hold(len(documents)):
            result = await engine.rerank(request.query, documents, params)
        call.answered(len(documents), result.prompt_tokens, result.timing)
        results = [
            pb.RerankResult(index=r.index, score=r.score, document=documents[r.index] if request.return_documents else "")
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
            truncation_direction=_direction(request.truncation_direction),
            raw_scores=request.raw_scores,
            candidate_labels=tuple(request.candidate_labels),
            hypothesis_template=request.hypothesis_template,
            multi_label=request.multi_label,
        )
        with self.frontend.hold(sequences):
            result = await engine.classify(texts, params)
        call.answered(len(texts), result.prompt_tokens, result.timing)
        classifications = [
            pb.Classification(
                scores=[pb.LabelScore(label=label, score=score) for label, score in zip(result.labels, row)],
                label=result.labels[best],
                score=row[best],
            )
            for row, best in zip(result.scores.tolist(), result.scores.argmax(axis=1).tolist())
        ]
        summary = call_summary(result.prompt_tokens, result.timing, engine.info.name, received)
        return pb.ClassifyResponse(classifications=classifications, **summary)

    @stream_call
    async def Generate(self, request, context, call):
        engine = self._engine(request.model, call)
        self.frontend.check_chars(request.prompt, "prompt")
        self.frontend.check_chars(request.decoder_prompt, "decoder_prompt")
        params = sampling_params(request)
        with self.frontend.hold(1):
            async for delta in engine.generate(request.prompt, params, decoder_prompt=request.decoder_prompt):
                if delta.finish_reason is not None:
                    call.answered(1, delta.prompt_tokens)
                    metrics.GENERATED_TOKENS.labels(call.model).inc(delta.completion_tokens)
                yield generate_response(delta)


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> str:
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    return pb.DESCRIPTOR.services_by_name["Inference"].full_name
