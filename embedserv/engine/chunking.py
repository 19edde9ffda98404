"""Long inputs by windows (CHUNKING_MEAN for Embed, CHUNKING_MAX for Rerank). Placeholder: being written."""

from __future__ import annotations


async def embed_chunked(engine, texts, params, received):
    raise NotImplementedError("chunked Embed is being written")


async def rerank_chunked(engine, query, documents, params, received):
    raise NotImplementedError("chunked Rerank is being written")
