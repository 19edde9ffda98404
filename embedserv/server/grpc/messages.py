"""embedserv.v1 messages to and from the engine's types: request params, response messages, ListModels' records."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from embedserv.config import ServerConfig
from embedserv.engine.inputs.image_inputs import simplest_input
from embedserv.engine.tasks.entities import DEFAULT_IGNORE_LABELS, Aggregation, Entity, TokenScores
from embedserv.engine.tasks.outputs import to_little_endian_bytes
from embedserv.engine.tasks.token_classification import TokenClassifyParams, TokenClassifyResult
from embedserv.errors import InvalidInput
from embedserv.types import (
    ChunkSplitter,
    EmbedInput,
    EmbedOutput,
    EmbedParams,
    EmbedResult,
    Encoding,
    FinishReason,
    GenerationDelta,
    ImageInput,
    KvCacheUsage,
    LateChunking,
    ModelInfo,
    SamplingParams,
    SparseVector,
    Task,
    Timing,
    TruncationDirection,
)
from embedserv.v1 import embedserv_pb2 as pb

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
    Task.TOKEN_CLASSIFY: pb.TASK_TOKEN_CLASSIFY,
}
_AGGREGATIONS = {
    pb.AGGREGATION_NONE: Aggregation.NONE,
    pb.AGGREGATION_SIMPLE: Aggregation.SIMPLE,
    pb.AGGREGATION_FIRST: Aggregation.FIRST,
    pb.AGGREGATION_AVERAGE: Aggregation.AVERAGE,
    pb.AGGREGATION_MAX: Aggregation.MAX,
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


_SPLITTERS = {
    pb.CHUNK_SPLITTER_SPANS: ChunkSplitter.SPANS,
    pb.CHUNK_SPLITTER_SENTENCES: ChunkSplitter.SENTENCES,
    pb.CHUNK_SPLITTER_TOKENS: ChunkSplitter.TOKENS,
}


def late_chunking_params(request: pb.EmbedRequest) -> LateChunking | None:
    """None when the request has no late_chunking message (an empty message asks for the spans splitter)."""
    if not request.HasField("late_chunking"):
        return None
    late = request.late_chunking
    if late.splitter not in _SPLITTERS:
        raise InvalidInput(
            f"unknown late_chunking.splitter {late.splitter}; use CHUNK_SPLITTER_SPANS, _SENTENCES or _TOKENS"
        )
    return LateChunking(
        splitter=_SPLITTERS[late.splitter],
        spans=tuple(tuple((span.start, span.end) for span in entry.spans) for entry in late.spans),
        chunk_tokens=late.chunk_tokens,
        overlap_tokens=late.overlap_tokens,
    )


def chunks_messages(
    result: EmbedResult, embeddings: Callable[[np.ndarray], list[pb.Embedding]]
) -> list[pb.InputChunks]:
    """EmbedResponse.chunks: per input, its chunks with their vectors as `embeddings` writes a call's rows."""
    if result.chunks is None:
        return []
    return [
        pb.InputChunks(
            chunks=[
                pb.Chunk(start=start, end=end, embedding=embedding)
                for (start, end), embedding in zip(spans, embeddings(rows), strict=True)
            ]
        )
        for spans, rows in result.chunks
    ]


def embed_params(request: pb.EmbedRequest) -> EmbedParams:
    if request.encoding not in _ENCODINGS:
        names = ", ".join(pb.Encoding.Name(value) for value in _ENCODINGS)
        raise InvalidInput(f"unknown encoding {request.encoding}; use one of {names}")
    unknown = [value for value in request.outputs if value not in _OUTPUTS]
    if unknown:
        raise InvalidInput(f"unknown output {unknown[0]}; use OUTPUT_DENSE, OUTPUT_SPARSE or OUTPUT_MULTI_VECTOR")
    if request.chunking not in (pb.CHUNKING_NONE, pb.CHUNKING_MEAN):
        name = _chunking_name(request.chunking)
        raise InvalidInput(f"Embed chunks with CHUNKING_MEAN (or CHUNKING_NONE), not {name}")
    return EmbedParams(
        normalize=request.normalize if request.HasField("normalize") else True,
        truncate=truncate_of(request),
        truncation_direction=direction(request.truncation_direction),
        dimensions=request.dimensions if request.HasField("dimensions") else None,
        prompt_name=request.prompt_name or None,
        outputs=tuple(_OUTPUTS[value] for value in request.outputs) or (EmbedOutput.DENSE,),
        chunking=request.chunking == pb.CHUNKING_MEAN,
        sparse_top_k=request.sparse_top_k if request.HasField("sparse_top_k") else None,
        encoding=_ENCODINGS[request.encoding],
        task=request.task or None,
        late_chunking=late_chunking_params(request) if request.HasField("late_chunking") else None,
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


def rerank_chunking(value: int) -> bool:
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


def direction(value: int) -> TruncationDirection:
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
        chunks=chunks_messages(result, lambda rows: embedding_messages(rows, encoding)) if result.chunks else [],
        sparse_embeddings=[sparse_message(v) for v in result.sparse] if result.sparse is not None else [],
        multi_vectors=[multi_vector_message(v) for v in result.multi_vectors or ()],
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


def server_limits(config: ServerConfig, receive_limit: int) -> pb.ServerLimits:
    return pb.ServerLimits(
        max_client_batch_size=config.max_client_batch_size,
        max_input_chars=config.max_input_chars,
        max_concurrent_requests=config.max_concurrent_requests,
        max_receive_message_bytes=receive_limit,
        max_images_per_request=config.max_images_per_request,
    )


def model_info(info: ModelInfo, kv_cache: KvCacheUsage | None = None, image_limits: tuple[int, int] = (0, 0)):
    """ListModels' record of a model; `image_limits`: its --max-image-bytes and --max-image-pixels (0 for a model
    that takes text only)."""
    return pb.ModelInfo(
        name=info.name,
        tasks=[_TASKS[t] for t in info.tasks],
        architecture=info.architecture,
        attention=pb.ATTENTION_KIND_CAUSAL if info.is_causal else pb.ATTENTION_KIND_BIDIRECTIONAL,
        pooling=info.pooling,
        dimension=info.dimension,
        max_input_tokens=info.max_input_tokens,
        prompt_names=list(info.prompt_names),
        adapters=list(info.task_adapters),
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
        labels=list(info.labels),
        is_encoder_decoder=info.is_encoder_decoder,
        kv_cache=pb.KvCache(**dataclasses.asdict(kv_cache)) if kv_cache is not None else None,
        kv_sharing=pb.KvSharing(
            shared_layers=[pb.KvSharing.SharedLayer(layer=a, source_layer=b) for a, b in info.kv_shared_layers],
            fast_prefill=info.kv_sharing_fast_prefill,
        )
        if info.kv_shared_layers
        else None,
        outputs=[_OUTPUT_ENUMS[o] for o in info.outputs],
        sparse_dimension=info.sparse_dimension,
        multi_vector_dimension=info.multi_vector_dimension,
        base_model=info.base_model,
        lora_adapters=list(info.lora_adapters),
        auto_truncate=info.auto_truncate,
        modalities=[m.value for m in info.modalities],
        max_image_bytes=image_limits[0],
        max_image_pixels=image_limits[1],
    )


def input_items(request: pb.EmbedRequest) -> list[EmbedInput] | None:
    """EmbedRequest.items as texts and images (with their image_text, or their parts in order) in order; None when
    the call sends `inputs` instead."""
    if not request.items:
        return None
    if request.inputs:
        raise InvalidInput("send inputs or items, not both: items holds texts and images in one list")
    return [input_item(item, f"items[{index}]") for index, item in enumerate(request.items)]


def input_item(item: pb.InputItem, what: str) -> EmbedInput:
    """One InputItem as a text, an image with its image_text, or its parts (texts and images in order)."""
    kind = item.WhichOneof("kind")
    if item.parts:
        if kind is not None or item.image_text:
            raise InvalidInput(
                f"{what} sets parts beside {kind or 'image_text'}; parts hold the whole input (its texts and images "
                "in order): put the text or image among them"
            )
        return simplest_input([_part(part, f"{what}.parts[{index}]") for index, part in enumerate(item.parts)])
    if kind is None:
        raise InvalidInput(f"{what} holds neither a text nor an image; set one of them, or parts")
    if kind == "text" and item.image_text:
        raise InvalidInput(
            f"{what} sets image_text beside a text; image_text is the text after an image in the same "
            "input: set image with it, or put the whole text in text"
        )
    return item.text if kind == "text" else ImageInput(item.image, item.image_text)


def _part(part: pb.InputPart, what: str) -> str | bytes:
    kind = part.WhichOneof("kind")
    if kind is None:
        raise InvalidInput(f"{what} holds neither a text nor an image; set one of them")
    return part.text if kind == "text" else part.image


def rerank_inputs(request: pb.RerankRequest) -> tuple[EmbedInput, list[EmbedInput], str]:
    """RerankRequest's query (query or query_item) and documents (documents, document_images or document_items),
    each given one way, and the documents' field name."""
    query: EmbedInput = request.query
    if request.HasField("query_item"):
        if request.query:
            raise InvalidInput("send query or query_item, not both: query_item holds the query as a text or an image")
        query = input_item(request.query_item, "query_item")
    given = [name for name in ("documents", "document_images", "document_items") if getattr(request, name)]
    if len(given) > 1:
        raise InvalidInput(
            f"send {' or '.join(given)}, not both"
            if len(given) == 2
            else "send one of documents, document_images and document_items, not all three"
        )
    if request.document_items:
        items = request.document_items
        return query, [input_item(item, f"document_items[{index}]") for index, item in enumerate(items)], given[0]
    if request.document_images:
        return query, [ImageInput(data) for data in request.document_images], given[0]
    return query, list(request.documents), "documents"


def token_classify_params(request: pb.ClassifyTokensRequest) -> TokenClassifyParams:
    if request.aggregation not in _AGGREGATIONS:
        raise InvalidInput(f"unknown aggregation {request.aggregation}; use NONE, SIMPLE, FIRST, AVERAGE or MAX")
    ignore = tuple(request.ignore_labels.labels) if request.HasField("ignore_labels") else DEFAULT_IGNORE_LABELS
    return TokenClassifyParams(
        aggregation=_AGGREGATIONS[request.aggregation],
        ignore_labels=ignore,
        truncate=truncate_of(request),
        truncation_direction=direction(request.truncation_direction),
    )


def token_classifications(result: TokenClassifyResult, all_scores: bool) -> list[pb.TokenClassification]:
    """One TokenClassification per input: its tokens (every label's probability with all_scores), its entities."""
    return [
        pb.TokenClassification(
            tokens=[_token_label(token, result.labels, all_scores) for token in tokens],
            entities=[_entity(entity) for entity in entities],
        )
        for tokens, entities in zip(result.tokens, result.entities, strict=True)
    ]


def _token_label(token: TokenScores, labels: tuple[str, ...], all_scores: bool) -> pb.TokenLabel:
    best = token.best
    return pb.TokenLabel(
        index=token.index,
        token=token.word,
        start=token.start,
        end=token.end,
        label=labels[best],
        score=float(token.scores[best]),
        scores=token.scores.tolist() if all_scores else (),
    )


def _entity(entity: Entity) -> pb.Entity:
    return pb.Entity(
        label=entity.label, score=entity.score, word=entity.word, start=entity.start, end=entity.end, index=entity.index
    )
