"""What the client returns: plain dataclasses built from the protobuf replies, and the one error it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import numpy as np

from embedserv_client.v1 import embedserv_pb2 as pb

_TASKS = {
    pb.TASK_EMBED: "embed",
    pb.TASK_RERANK: "rerank",
    pb.TASK_CLASSIFY: "classify",
    pb.TASK_GENERATE: "generate",
    pb.TASK_EMBED_SPARSE: "embed_sparse",
    pb.TASK_EMBED_MULTI_VECTOR: "embed_multi_vector",
    pb.TASK_TOKEN_CLASSIFY: "token_classify",
}
# Embed's outputs by the names the client takes and reports.
OUTPUTS = {"dense": pb.OUTPUT_DENSE, "sparse": pb.OUTPUT_SPARSE, "multi_vector": pb.OUTPUT_MULTI_VECTOR}
_OUTPUT_NAMES = {value: name for name, value in OUTPUTS.items()}
_ATTENTION = {pb.ATTENTION_KIND_BIDIRECTIONAL: "bidirectional", pb.ATTENTION_KIND_CAUSAL: "causal"}
FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


class EmbedservError(Exception):
    """A call that failed: the gRPC status code, the server's message and the server's request id."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str | None = None):
        super().__init__(f"{code.name}: {details}" + (f" (request id {request_id})" if request_id else ""))
        self.code = code
        self.details = details
        self.request_id = request_id


def error_from(err: grpc.RpcError) -> EmbedservError:
    """Our error for a gRPC one; the server names each call's request id in its trailing metadata."""
    request_id = None
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "x-request-id":
            request_id = value
    details = err.details() if hasattr(err, "details") else str(err)
    return EmbedservError(err.code(), details or "", request_id)


@dataclass(frozen=True)
class Limits:
    """What one call may carry (ListModels' `limits`)."""

    max_client_batch_size: int
    max_input_chars: int
    max_concurrent_requests: int
    max_receive_message_bytes: int
    # Images one call may carry (0: the server takes none, or predates images).
    max_images_per_request: int = 0

    @classmethod
    def from_proto(cls, message: pb.ServerLimits) -> Limits:
        return cls(
            max_client_batch_size=message.max_client_batch_size,
            max_input_chars=message.max_input_chars,
            max_concurrent_requests=message.max_concurrent_requests,
            max_receive_message_bytes=message.max_receive_message_bytes,
            max_images_per_request=message.max_images_per_request,
        )


@dataclass(frozen=True)
class KvCache:
    block_size: int
    total_blocks: int
    used_blocks: int
    preemptions: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class KvSharing:
    # (layer, source layer): each attention layer that reads an earlier layer's KV cache.
    shared_layers: tuple[tuple[int, int], ...]
    # The layers after the last KV writer run only the rows whose output is read.
    fast_prefill: bool


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tasks: tuple[str, ...]
    architecture: str
    attention: str
    pooling: str
    dimension: int
    max_input_tokens: int
    prompt_names: tuple[str, ...]
    dtype: str
    device: str
    attention_backend: str
    labels: tuple[str, ...]
    kv_cache: KvCache | None = None
    is_encoder_decoder: bool = False
    kv_sharing: KvSharing | None = None
    # What embed() can return ("dense", "sparse", "multi_vector"; empty for models that do not embed), the
    # sparse output's dimension (the vocabulary size) and the multi-vector output's per-vector dimension.
    outputs: tuple[str, ...] = ()
    sparse_dimension: int = 0
    multi_vector_dimension: int = 0
    # The task adapters embed(task=...) may name (jina-embeddings-v3's retrieval.query, ...); usually empty.
    adapters: tuple[str, ...] = ()
    # Served with --auto-truncate: a call that leaves `truncate` None has its too-long inputs cut, not refused.
    auto_truncate: bool = False
    # The inputs it takes ("text", "image"): embed(images=...) and friends need "image"; and the encoded bytes
    # and decoded pixels one image may have (0 for a model that takes text only).
    modalities: tuple[str, ...] = ("text",)
    max_image_bytes: int = 0
    max_image_pixels: int = 0

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> ModelInfo:
        kv = m.kv_cache
        return cls(
            name=m.name,
            tasks=tuple(_TASKS[t] for t in m.tasks if t in _TASKS),
            architecture=m.architecture,
            attention=_ATTENTION.get(m.attention, "unspecified"),
            pooling=m.pooling,
            dimension=m.dimension,
            max_input_tokens=m.max_input_tokens,
            prompt_names=tuple(m.prompt_names),
            dtype=m.dtype,
            device=m.device,
            attention_backend=m.attention_backend,
            labels=tuple(m.labels),
            kv_cache=(
                KvCache(kv.block_size, kv.total_blocks, kv.used_blocks, kv.preemptions, kv.cached_prompt_tokens)
                if m.HasField("kv_cache")
                else None
            ),
            is_encoder_decoder=m.is_encoder_decoder,
            kv_sharing=(
                KvSharing(
                    tuple((s.layer, s.source_layer) for s in m.kv_sharing.shared_layers), m.kv_sharing.fast_prefill
                )
                if m.HasField("kv_sharing")
                else None
            ),
            outputs=tuple(_OUTPUT_NAMES[o] for o in m.outputs if o in _OUTPUT_NAMES),
            sparse_dimension=m.sparse_dimension,
            multi_vector_dimension=m.multi_vector_dimension,
            adapters=tuple(m.adapters),
            auto_truncate=m.auto_truncate,
            # A server from before images names no modalities: it takes text.
            modalities=tuple(m.modalities) or ("text",),
            max_image_bytes=m.max_image_bytes,
            max_image_pixels=m.max_image_pixels,
        )


class SparseEmbedding(NamedTuple):
    """One input's sparse vector: vocabulary ids (int64, ascending) and their float32 values, non-zero only.
    A tuple, so `indices, values = client.embed_sparse(text)` works."""

    indices: np.ndarray
    values: np.ndarray

    @classmethod
    def from_proto(cls, e: pb.SparseEmbedding) -> SparseEmbedding:
        return cls(np.asarray(e.indices, dtype=np.int64), np.asarray(e.values, dtype=np.float32))

    def to_dense(self, dimension: int) -> np.ndarray:
        """The vector as a float32 array of `dimension` (the model's sparse_dimension)."""
        dense = np.zeros(dimension, dtype=np.float32)
        dense[self.indices] = self.values
        return dense


def multi_vector(m: pb.MultiVector) -> np.ndarray:
    """[num_vectors, dimension] float32 from a MultiVector (little-endian float32 rows), writable."""
    return np.frombuffer(m.raw, dtype="<f4").reshape(m.num_vectors, m.dimension).astype(np.float32)


@dataclass(frozen=True)
class EmbedOutputs:
    """What embed(outputs=[...]) returns: each output asked for, in input order; None for those not asked.

    `dense`: [n, d] in the call's encoding's dtype; `sparse`: a SparseEmbedding per input; `multi_vector`: a
    [num_vectors, dim] float32 array per input. For one string: [d], one SparseEmbedding, one array.
    `encoding_scale`, for int8 / uint8 (0 otherwise): value ~ code * scale (int8); value minus the vector's mean
    ~ (code - 128) * scale (uint8)."""

    dense: np.ndarray | None = None
    sparse: list[SparseEmbedding] | SparseEmbedding | None = None
    multi_vector: list[np.ndarray] | np.ndarray | None = None
    encoding_scale: float = 0.0


@dataclass(frozen=True)
class RerankResult:
    """One document's score; `index` is its position in the documents given."""

    index: int
    score: float
    document: str | None = None


@dataclass(frozen=True)
class Classification:
    """The best label and its score, and every label's score in the model's label order (zero-shot: the
    candidate labels, in the order given)."""

    label: str
    score: float
    scores: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, c: pb.Classification) -> Classification:
        return cls(label=c.label, score=c.score, scores={s.label: s.score for s in c.scores})


@dataclass(frozen=True)
class Token:
    """A token as the model sees it; `start`/`end` are character offsets into the input (0, 0 if special)."""

    id: int
    text: str
    start: int
    end: int
    special: bool


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
