"""OpenAI-compatible routes: /v1/embeddings and /v1/models (completions and chat: openai_generate.py).

Shapes follow OpenAI's API reference, so the openai SDK, LangChain, LlamaIndex and Haystack clients work by
changing their base URL. Extensions a client may send beside OpenAI's fields: `truncate` (cut inputs past
the model's limit instead of refusing them), `prompt_name` (a sentence-transformers prompt),
`normalize` (default true, as OpenAI's vectors are unit length), `embedding_type` (a compact encoding of the
vectors, see `embeddings`), `chunking` ("mean": texts past the model's limit are embedded by windows) and
`late_chunking` (one vector per chunk of each text; late_chunks.py).
"""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field

from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body, call_of, engine_named, frontend_of
from embedserv.server.http.error_responses import JSON
from embedserv.server.http.late_chunks import LateChunkingBody, chunk_items
from embedserv.server.http.openai_generate import router as generation_router
from embedserv.types import EmbedParams, Encoding, ModelInfo, TruncationDirection

router = APIRouter()
router.include_router(generation_router)
_STARTED = int(time.time())


class EmbeddingsBody(Body):
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, token ids, or a list of token-id lists (used as given)."
    )
    model: str | None = Field(None, description="A served model name; empty or absent: the first served model.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Keep the first N dimensions (Matryoshka), then normalize.")
    user: str | None = None
    truncate: bool | None = Field(
        None, description="Extension: cut inputs past the model's limit instead of refusing (unset: --auto-truncate)."
    )
    prompt_name: str | None = Field(None, description="Extension: a prompt of the model's sentence-transformers config.")
    task: str | None = Field(
        None,
        description="Extension: the task adapter to run with (the model's adapters, e.g. jina-embeddings-v3's "
        "retrieval.query), and that task's prompt unless prompt_name names one.",
    )
    normalize: bool = Field(True, description="Extension: L2-normalize each vector.")
    embedding_type: Literal[
        "float32", "float16", "int8", "uint8", "int8_per_dimension", "uint8_per_dimension", "binary", "ubinary"
    ] = Field(
        "float32",
        description="Extension: the vectors' encoding (float32, float16; int8/uint8 codes whose raw integer dot "
        "products rank as the floats do, with the response's encoding_scale; int8/uint8_per_dimension: "
        "sentence-transformers' per-dimension calibration buckets; binary/ubinary packed bits); with "
        "encoding_format float integers come as lists of ints, with base64 the raw little-endian bytes.",
    )
    chunking: Literal["mean"] | None = Field(
        None, description="Extension: mean embeds texts past the model's limit by windows (token-count-weighted mean)."
    )
    late_chunking: LateChunkingBody | None = Field(
        None, description="Extension: one vector per chunk of each text, pooled from the whole text's token states."
    )
    bypass_cache: bool = Field(
        False, description="Extension: neither read nor fill the model's embedding cache (--embedding-cache)."
    )


class EmbeddingItem(Body):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | list[int] | str
    # late_chunking: the chunk's input and its [start, end) character span.
    input_index: int | None = None
    start: int | None = None
    end: int | None = None


class Usage(Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(Body):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: Usage
    encoding_scale: float | None = Field(
        None, description="Extension, with embedding_type int8 / uint8 only: the codes' scale (see embeddings)."
    )


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], (int, list))


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, tags=["OpenAI"])
async def embeddings(request: Request, body: EmbeddingsBody):
    """OpenAI's embeddings. `embedding_type` (an extension; default float32) picks the vectors' encoding:
    float16 (the float32 values cast); int8 (value ~ code * encoding_scale, one scale per model) and uint8
    (value - the vector's mean ~ (code - 128) * encoding_scale), whose raw integer dot products rank as the
    floats do, for vector databases; int8_per_dimension / uint8_per_dimension (each dimension's bucket of 256
    between the model's calibration minimum and maximum, as sentence-transformers' quantize_embeddings, for
    rescoring); binary / ubinary (one bit per dimension, value > 0, packed 8 to a byte, most significant bit
    first: [ceil(dimension / 8)] int8 / uint8). int8 / uint8 responses carry `encoding_scale` (an extension).
    With encoding_format float each embedding is a list of numbers (floats for float32 / float16, ints for the
    rest); with base64, the base64 of its raw little-endian bytes (4, 2 or 1 per value).
    `chunking: "mean"` (an extension, text inputs only) embeds texts past the model's limit by windows."""
    frontend = frontend_of(request)
    engine = engine_named(request, body.model)
    params = EmbedParams(
        normalize=body.normalize,
        truncate=body.truncate,
        truncation_direction=TruncationDirection.RIGHT,
        dimensions=body.dimensions,
        prompt_name=body.prompt_name,
        chunking=body.chunking == "mean",
        encoding=Encoding(body.embedding_type),
        task=body.task,
        late_chunking=body.late_chunking.params() if body.late_chunking is not None else None,
        bypass_cache=body.bypass_cache,
    )
    inputs = body.input if isinstance(body.input, list) else [body.input]
    if _is_token_ids(inputs):
        if params.chunking:
            raise InvalidInput("chunking applies to text inputs; token-id inputs are used as given")
        token_ids = [inputs] if isinstance(inputs[0], int) else inputs
        frontend.check_batch(len(token_ids), "input")
        with frontend.hold(len(token_ids)):
            result = await engine.embed_token_ids(token_ids, params)
    else:
        texts = frontend.check_inputs(inputs, "input")
        with frontend.hold(len(texts)):
            result = await engine.embed(texts, params)
    answered = result.chunks if result.chunks is not None else result.embeddings
    call_of(request).answered(len(answered), result.prompt_tokens, result.timing)
    if result.chunks is not None:
        data = chunk_items(result, _vectors(np.concatenate([rows for _, rows in result.chunks]), body.encoding_format))
    else:
        vectors = _vectors(result.embeddings, body.encoding_format)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    response = {"object": "list", "data": data, "model": engine.info.name, "usage": usage}
    if result.encoding_scale:
        response["encoding_scale"] = result.encoding_scale
    return JSON(response)


def _vectors(rows: np.ndarray, encoding_format: str) -> list:
    if encoding_format == "base64":
        rows = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    return list(np.ascontiguousarray(rows))  # orjson writes each value's shortest repr


def model_card(info: ModelInfo) -> dict:
    """OpenAI's model object, with what a client may want to know about it (extensions)."""
    return {
        "id": info.name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "embedserv",
        "tasks": [task.value for task in info.tasks],
        "max_model_len": info.max_input_tokens,
        "dimension": info.dimension or None,
        # vLLM's fields: a --lora adapter's parent (and root) is its base model; a base model is its own root.
        "root": info.base_model or info.name,
        "parent": info.base_model or None,
    }


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(request: Request):
    served = frontend_of(request).models
    cards = [model_card(e.info) for base in served.engines for e in (base, *served.adapter_engines(base))]
    return JSON({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def retrieve_model(request: Request, model: str):
    return JSON(model_card(frontend_of(request).engine(model).info))

