"""embedserv-client: call an embedserv server from Python.

    from embedserv_client import Client

    with Client("127.0.0.1:50051") as client:
        vectors = client.embed(["a sentence", "another"])  # numpy float32, [2, dimension]

AsyncClient has the same calls, awaited. The generated stubs are in embedserv_client.v1."""

from embedserv_client.aio import AsyncClient
from embedserv_client.client import Client
from embedserv_client.images import Interleaved
from embedserv_client.late_chunks import TextChunks
from embedserv_client.options import NO_RETRY, RetryPolicy, Tls
from embedserv_client.streams import AsyncTextStream, TextStream
from embedserv_client.token_classes import Entity, TokenClassification, TokenLabel
from embedserv_client.types import (
    Classification,
    EmbedOutputs,
    EmbedservError,
    KvCache,
    KvSharing,
    Limits,
    ModelInfo,
    RerankResult,
    SparseEmbedding,
    Token,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "NO_RETRY",
    "AsyncClient",
    "AsyncTextStream",
    "Classification",
    "Client",
    "EmbedOutputs",
    "EmbedservError",
    "Entity",
    "Interleaved",
    "KvCache",
    "KvSharing",
    "Limits",
    "ModelInfo",
    "RerankResult",
    "RetryPolicy",
    "SparseEmbedding",
    "TextChunks",
    "TextStream",
    "Tls",
    "Token",
    "TokenClassification",
    "TokenLabel",
    "Usage",
]
