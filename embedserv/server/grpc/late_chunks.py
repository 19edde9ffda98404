"""EmbedRequest.late_chunking on the wire: the request's LateChunking message to the engine's, and each input's
chunks (spans and vectors) to EmbedResponse.chunks."""

from __future__ import annotations

from typing import Callable

import numpy as np

from embedserv.errors import InvalidInput
from embedserv.types import ChunkSplitter, EmbedResult, LateChunking
from embedserv.v1 import embedserv_pb2 as pb

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
        pb.InputChunks(chunks=[
            pb.Chunk(start=start, end=end, embedding=embedding)
            for (start, end), embedding in zip(spans, embeddings(rows))
        ])
        for spans, rows in result.chunks
    ]
