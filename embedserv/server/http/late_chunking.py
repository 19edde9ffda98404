"""The OpenAI `/v1/embeddings` extension for late chunking: the body's `late_chunking` object and the chunks'
place in the answer.

Request: `"late_chunking": {"splitter": "spans" | "sentences" | "tokens", "spans": [[[start, end], ...], ...]
(one list per input), "chunk_tokens": N, "overlap_tokens": M}`. Answer: `data` holds one item per chunk, input
by input and in span order, each with OpenAI's fields (`index` is the item's place in `data`, `embedding` its
vector in the call's encoding_format and embedding_type) and three of ours: `input_index`, `start` and `end`.
A flat list keeps every OpenAI client able to read the vectors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from embedserv.types import ChunkSplitter, EmbedResult, LateChunking


class LateChunkingBody(BaseModel):
    # Unlike the top level, unknown fields are refused: a misspelt option would silently change the chunks.
    model_config = ConfigDict(extra="forbid")

    splitter: Literal["spans", "sentences", "tokens"] = Field(
        "spans", description="Where chunks come from: the given spans, sentences, or windows of chunk_tokens tokens."
    )
    spans: list[list[tuple[int, int]]] = Field(
        default_factory=list,
        description="splitter spans: per input, its chunks' [start, end) character (code point) offsets.",
    )
    chunk_tokens: int = Field(0, ge=0, description="splitter tokens: tokens per chunk.")
    overlap_tokens: int = Field(0, ge=0, description="splitter tokens: tokens neighbouring chunks share.")

    def params(self) -> LateChunking:
        return LateChunking(
            splitter=ChunkSplitter(self.splitter),
            spans=tuple(tuple((int(start), int(end)) for start, end in entry) for entry in self.spans),
            chunk_tokens=self.chunk_tokens,
            overlap_tokens=self.overlap_tokens,
        )


def chunk_items(result: EmbedResult, vectors: list) -> list[dict]:
    """OpenAI data items, one per chunk; `vectors` are the chunks' vectors as the answer writes them, in order."""
    items = []
    placed = ((index, span) for index, (spans, _) in enumerate(result.chunks) for span in spans)
    for position, ((input_index, (start, end)), vector) in enumerate(zip(placed, vectors, strict=True)):
        items.append(
            {
                "object": "embedding",
                "index": position,
                "embedding": vector,
                "input_index": input_index,
                "start": start,
                "end": end,
            }
        )
    return items
