from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_DIRECTION_RIGHT: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_LEFT: _ClassVar[TruncationDirection]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FLOAT: _ClassVar[Encoding]
    ENCODING_BYTES: _ClassVar[Encoding]
    ENCODING_FLOAT16: _ClassVar[Encoding]
    ENCODING_INT8: _ClassVar[Encoding]
    ENCODING_UINT8: _ClassVar[Encoding]
    ENCODING_BINARY: _ClassVar[Encoding]
    ENCODING_UBINARY: _ClassVar[Encoding]
    ENCODING_INT8_PER_DIMENSION: _ClassVar[Encoding]
    ENCODING_UINT8_PER_DIMENSION: _ClassVar[Encoding]

class ChunkSplitter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNK_SPLITTER_SPANS: _ClassVar[ChunkSplitter]
    CHUNK_SPLITTER_SENTENCES: _ClassVar[ChunkSplitter]
    CHUNK_SPLITTER_TOKENS: _ClassVar[ChunkSplitter]

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_DENSE: _ClassVar[Output]
    OUTPUT_SPARSE: _ClassVar[Output]
    OUTPUT_MULTI_VECTOR: _ClassVar[Output]

class Chunking(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHUNKING_NONE: _ClassVar[Chunking]
    CHUNKING_MEAN: _ClassVar[Chunking]
    CHUNKING_MAX: _ClassVar[Chunking]

class Aggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGGREGATION_NONE: _ClassVar[Aggregation]
    AGGREGATION_SIMPLE: _ClassVar[Aggregation]
    AGGREGATION_FIRST: _ClassVar[Aggregation]
    AGGREGATION_AVERAGE: _ClassVar[Aggregation]
    AGGREGATION_MAX: _ClassVar[Aggregation]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TASK_EMBED: _ClassVar[Task]
    TASK_RERANK: _ClassVar[Task]
    TASK_CLASSIFY: _ClassVar[Task]
    TASK_GENERATE: _ClassVar[Task]
    TASK_EMBED_SPARSE: _ClassVar[Task]
    TASK_EMBED_MULTI_VECTOR: _ClassVar[Task]
    TASK_TOKEN_CLASSIFY: _ClassVar[Task]

class AttentionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_KIND_UNSPECIFIED: _ClassVar[AttentionKind]
    ATTENTION_KIND_BIDIRECTIONAL: _ClassVar[AttentionKind]
    ATTENTION_KIND_CAUSAL: _ClassVar[AttentionKind]
TRUNCATION_DIRECTION_RIGHT: TruncationDirection
TRUNCATION_DIRECTION_LEFT: TruncationDirection
ENCODING_FLOAT: Encoding
ENCODING_BYTES: Encoding
ENCODING_FLOAT16: Encoding
ENCODING_INT8: Encoding
ENCODING_UINT8: Encoding
ENCODING_BINARY: Encoding
ENCODING_UBINARY: Encoding
ENCODING_INT8_PER_DIMENSION: Encoding
ENCODING_UINT8_PER_DIMENSION: Encoding
CHUNK_SPLITTER_SPANS: ChunkSplitter
CHUNK_SPLITTER_SENTENCES: ChunkSplitter
CHUNK_SPLITTER_TOKENS: ChunkSplitter
OUTPUT_DENSE: Output
OUTPUT_SPARSE: Output
OUTPUT_MULTI_VECTOR: Output
CHUNKING_NONE: Chunking
CHUNKING_MEAN: Chunking
CHUNKING_MAX: Chunking
AGGREGATION_NONE: Aggregation
AGGREGATION_SIMPLE: Aggregation
AGGREGATION_FIRST: Aggregation
AGGREGATION_AVERAGE: Aggregation
AGGREGATION_MAX: Aggregation
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason
TASK_UNSPECIFIED: Task
TASK_EMBED: Task
TASK_RERANK: Task
TASK_CLASSIFY: Task
TASK_GENERATE: Task
TASK_EMBED_SPARSE: Task
TASK_EMBED_MULTI_VECTOR: Task
TASK_TOKEN_CLASSIFY: Task
ATTENTION_KIND_UNSPECIFIED: AttentionKind
ATTENTION_KIND_BIDIRECTIONAL: AttentionKind
ATTENTION_KIND_CAUSAL: AttentionKind

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_us", "tokenization_us", "inference_us", "total_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    TOKENIZATION_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    tokenization_us: int
    inference_us: int
    total_us: int
    def __init__(self, queue_us: _Optional[int] = ..., tokenization_us: _Optional[int] = ..., inference_us: _Optional[int] = ..., total_us: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "normalize", "truncate", "truncation_direction", "dimensions", "prompt_name", "encoding", "outputs", "chunking", "sparse_top_k", "task", "late_chunking", "bypass_cache", "items", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    LATE_CHUNKING_FIELD_NUMBER: _ClassVar[int]
    BYPASS_CACHE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    truncate: bool
    truncation_direction: TruncationDirection
    dimensions: int
    prompt_name: str
    encoding: Encoding
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    chunking: Chunking
    sparse_top_k: int
    task: str
    late_chunking: LateChunking
    bypass_cache: bool
    items: _containers.RepeatedCompositeFieldContainer[InputItem]
    priority: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., dimensions: _Optional[int] = ..., prompt_name: _Optional[str] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., chunking: _Optional[_Union[Chunking, str]] = ..., sparse_top_k: _Optional[int] = ..., task: _Optional[str] = ..., late_chunking: _Optional[_Union[LateChunking, _Mapping]] = ..., bypass_cache: _Optional[bool] = ..., items: _Optional[_Iterable[_Union[InputItem, _Mapping]]] = ..., priority: _Optional[int] = ...) -> None: ...

class InputItem(_message.Message):
    __slots__ = ("text", "image", "image_text", "parts")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TEXT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    image_text: str
    parts: _containers.RepeatedCompositeFieldContainer[InputPart]
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ..., image_text: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[InputPart, _Mapping]]] = ...) -> None: ...

class InputPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class CharSpans(_message.Message):
    __slots__ = ("spans",)
    SPANS_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[CharSpan]
    def __init__(self, spans: _Optional[_Iterable[_Union[CharSpan, _Mapping]]] = ...) -> None: ...

class CharSpan(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LateChunking(_message.Message):
    __slots__ = ("splitter", "spans", "chunk_tokens", "overlap_tokens")
    SPLITTER_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    splitter: ChunkSplitter
    spans: _containers.RepeatedCompositeFieldContainer[CharSpans]
    chunk_tokens: int
    overlap_tokens: int
    def __init__(self, splitter: _Optional[_Union[ChunkSplitter, str]] = ..., spans: _Optional[_Iterable[_Union[CharSpans, _Mapping]]] = ..., chunk_tokens: _Optional[int] = ..., overlap_tokens: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("start", "end", "embedding")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    embedding: Embedding
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class InputChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "raw")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    raw: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., raw: _Optional[bytes] = ...) -> None: ...

class SparseEmbedding(_message.Message):
    __slots__ = ("indices", "values")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class MultiVector(_message.Message):
    __slots__ = ("num_vectors", "dimension", "raw")
    NUM_VECTORS_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    num_vectors: int
    dimension: int
    raw: bytes
    def __init__(self, num_vectors: _Optional[int] = ..., dimension: _Optional[int] = ..., raw: _Optional[bytes] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "usage", "model", "timing", "sparse_embeddings", "multi_vectors", "chunks", "encoding_scale")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SPARSE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MULTI_VECTORS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_SCALE_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    model: str
    timing: Timing
    sparse_embeddings: _containers.RepeatedCompositeFieldContainer[SparseEmbedding]
    multi_vectors: _containers.RepeatedCompositeFieldContainer[MultiVector]
    chunks: _containers.RepeatedCompositeFieldContainer[InputChunks]
    encoding_scale: float
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., sparse_embeddings: _Optional[_Iterable[_Union[SparseEmbedding, _Mapping]]] = ..., multi_vectors: _Optional[_Iterable[_Union[MultiVector, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[InputChunks, _Mapping]]] = ..., encoding_scale: _Optional[float] = ...) -> None: ...

class EmbedSparseRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "prompt_name", "top_k", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    truncation_direction: TruncationDirection
    prompt_name: str
    top_k: int
    priority: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., prompt_name: _Optional[str] = ..., top_k: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class EmbedSparseResponse(_message.Message):
    __slots__ = ("embeddings", "usage", "model", "timing")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[SparseEmbedding]
    usage: Usage
    model: str
    timing: Timing
    def __init__(self, embeddings: _Optional[_Iterable[_Union[SparseEmbedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class EmbedMultiVectorRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "prompt_name", "images", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    prompt_name: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    priority: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., prompt_name: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., priority: _Optional[int] = ...) -> None: ...

class EmbedMultiVectorResponse(_message.Message):
    __slots__ = ("embeddings", "usage", "model", "timing")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[MultiVector]
    usage: Usage
    model: str
    timing: Timing
    def __init__(self, embeddings: _Optional[_Iterable[_Union[MultiVector, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "raw_scores", "truncate", "instruction", "chunking", "document_images", "priority", "query_item", "document_items")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    CHUNKING_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUERY_ITEM_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_ITEMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    raw_scores: bool
    truncate: bool
    instruction: str
    chunking: Chunking
    document_images: _containers.RepeatedScalarFieldContainer[bytes]
    priority: int
    query_item: InputItem
    document_items: _containers.RepeatedCompositeFieldContainer[InputItem]
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., instruction: _Optional[str] = ..., chunking: _Optional[_Union[Chunking, str]] = ..., document_images: _Optional[_Iterable[bytes]] = ..., priority: _Optional[int] = ..., query_item: _Optional[_Union[InputItem, _Mapping]] = ..., document_items: _Optional[_Iterable[_Union[InputItem, _Mapping]]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("results", "usage", "model", "timing")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    model: str
    timing: Timing
    def __init__(self, results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "raw_scores", "candidate_labels", "hypothesis_template", "multi_label", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LABELS_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESIS_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MULTI_LABEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    truncation_direction: TruncationDirection
    raw_scores: bool
    candidate_labels: _containers.RepeatedScalarFieldContainer[str]
    hypothesis_template: str
    multi_label: bool
    priority: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., raw_scores: _Optional[bool] = ..., candidate_labels: _Optional[_Iterable[str]] = ..., hypothesis_template: _Optional[str] = ..., multi_label: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("scores", "label", "score")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[LabelScore]
    label: str
    score: float
    def __init__(self, scores: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ..., label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("classifications", "usage", "model", "timing")
    CLASSIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    classifications: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: Usage
    model: str
    timing: Timing
    def __init__(self, classifications: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class LabelList(_message.Message):
    __slots__ = ("labels",)
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, labels: _Optional[_Iterable[str]] = ...) -> None: ...

class ClassifyTokensRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "aggregation", "ignore_labels", "all_scores", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_LABELS_FIELD_NUMBER: _ClassVar[int]
    ALL_SCORES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    truncation_direction: TruncationDirection
    aggregation: Aggregation
    ignore_labels: LabelList
    all_scores: bool
    priority: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., aggregation: _Optional[_Union[Aggregation, str]] = ..., ignore_labels: _Optional[_Union[LabelList, _Mapping]] = ..., all_scores: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenLabel(_message.Message):
    __slots__ = ("index", "token", "start", "end", "label", "score", "scores")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: str
    start: int
    end: int
    label: str
    score: float
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, index: _Optional[int] = ..., token: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., label: _Optional[str] = ..., score: _Optional[float] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class Entity(_message.Message):
    __slots__ = ("label", "score", "word", "start", "end", "index")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    word: str
    start: int
    end: int
    index: int
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ..., word: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class TokenClassification(_message.Message):
    __slots__ = ("tokens", "entities")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLabel]
    entities: _containers.RepeatedCompositeFieldContainer[Entity]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLabel, _Mapping]]] = ..., entities: _Optional[_Iterable[_Union[Entity, _Mapping]]] = ...) -> None: ...

class ClassifyTokensResponse(_message.Message):
    __slots__ = ("inputs", "usage", "model", "timing")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[TokenClassification]
    usage: Usage
    model: str
    timing: Timing
    def __init__(self, inputs: _Optional[_Iterable[_Union[TokenClassification, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "decoder_prompt", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DECODER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    decoder_prompt: str
    priority: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., decoder_prompt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "inputs", "add_special_tokens", "prompt_name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    prompt_name: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "start", "end", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    start: int
    end: int
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., special: _Optional[bool] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("inputs", "model")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[TokenizedInput]
    model: str
    def __init__(self, inputs: _Optional[_Iterable[_Union[TokenizedInput, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "tasks", "architecture", "attention", "pooling", "dimension", "max_input_tokens", "prompt_names", "dtype", "device", "attention_backend", "labels", "kv_cache", "is_encoder_decoder", "kv_sharing", "outputs", "sparse_dimension", "multi_vector_dimension", "adapters", "base_model", "lora_adapters", "auto_truncate", "modalities", "max_image_bytes", "max_image_pixels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    IS_ENCODER_DECODER_FIELD_NUMBER: _ClassVar[int]
    KV_SHARING_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MULTI_VECTOR_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    AUTO_TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tasks: _containers.RepeatedScalarFieldContainer[Task]
    architecture: str
    attention: AttentionKind
    pooling: str
    dimension: int
    max_input_tokens: int
    prompt_names: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    device: str
    attention_backend: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    kv_cache: KvCache
    is_encoder_decoder: bool
    kv_sharing: KvSharing
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    sparse_dimension: int
    multi_vector_dimension: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    base_model: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    auto_truncate: bool
    modalities: _containers.RepeatedScalarFieldContainer[str]
    max_image_bytes: int
    max_image_pixels: int
    def __init__(self, name: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[Task, str]]] = ..., architecture: _Optional[str] = ..., attention: _Optional[_Union[AttentionKind, str]] = ..., pooling: _Optional[str] = ..., dimension: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., prompt_names: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., kv_cache: _Optional[_Union[KvCache, _Mapping]] = ..., is_encoder_decoder: _Optional[bool] = ..., kv_sharing: _Optional[_Union[KvSharing, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., sparse_dimension: _Optional[int] = ..., multi_vector_dimension: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., base_model: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., auto_truncate: _Optional[bool] = ..., modalities: _Optional[_Iterable[str]] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ...) -> None: ...

class KvSharing(_message.Message):
    __slots__ = ("shared_layers", "fast_prefill")
    class SharedLayer(_message.Message):
        __slots__ = ("layer", "source_layer")
        LAYER_FIELD_NUMBER: _ClassVar[int]
        SOURCE_LAYER_FIELD_NUMBER: _ClassVar[int]
        layer: int
        source_layer: int
        def __init__(self, layer: _Optional[int] = ..., source_layer: _Optional[int] = ...) -> None: ...
    SHARED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FAST_PREFILL_FIELD_NUMBER: _ClassVar[int]
    shared_layers: _containers.RepeatedCompositeFieldContainer[KvSharing.SharedLayer]
    fast_prefill: bool
    def __init__(self, shared_layers: _Optional[_Iterable[_Union[KvSharing.SharedLayer, _Mapping]]] = ..., fast_prefill: _Optional[bool] = ...) -> None: ...

class KvCache(_message.Message):
    __slots__ = ("block_size", "total_blocks", "used_blocks", "preemptions", "cached_prompt_tokens")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    used_blocks: int
    preemptions: int
    cached_prompt_tokens: int
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_client_batch_size", "max_input_chars", "max_concurrent_requests", "max_receive_message_bytes", "max_images_per_request")
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    max_client_batch_size: int
    max_input_chars: int
    max_concurrent_requests: int
    max_receive_message_bytes: int
    max_images_per_request: int
    def __init__(self, max_client_batch_size: _Optional[int] = ..., max_input_chars: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_receive_message_bytes: _Optional[int] = ..., max_images_per_request: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "limits")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    limits: ServerLimits
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ...) -> None: ...
