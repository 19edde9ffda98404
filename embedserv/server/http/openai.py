"""OpenAI-compatible routes: /v1/embeddings and /v1/models (completions and chat: openai_generate.py).

Shapes follow OpenAI's API reference, so the openai SDK, LangChain, LlamaIndex and Haystack clients work by
changing their base URL. Extensions a client may send beside OpenAI's fields: `truncate` (cut inputs past
the model's limit instead of refusing them), `prompt_name` (a sentence-transformers prompt),
`normalize` (default true, as OpenAI's vectors are unit length), `embedding_type` (a compact encoding of the
vectors, see `embeddings`), `chunking` ("mean": texts past the model's limit are embedded by windows) and
`late_chunking` (one vector per chunk of each text; late_chunking.py). /v1/embeddings takes OpenAI's 2048 inputs a
call (run in slices of --max-client-batch-size) and, as OpenAI does, refuses fields it does not know. Images
(models that take them) come as content parts in `input` or as vLLM's `messages` form (image_inputs.py).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, StrictBool, StrictInt

from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.frontend import Frontend
from embedserv.server.http.common import Body, RequestBody, call_of, engine_named, frontend_of
from embedserv.server.http.error_responses import JSON
from embedserv.server.http.image_inputs import (
    ContentPart,
    ImagePart,
    Message,
    TextPart,
    input_items,
    message_item,
)
from embedserv.server.http.late_chunking import LateChunkingBody, chunk_items
from embedserv.server.http.openai_generate import router as generation_router
from embedserv.types import EmbedInput, EmbedParams, EmbedResult, Encoding, ModelInfo, Timing, TruncationDirection

router = APIRouter()
router.include_router(generation_router)
_STARTED = int(time.time())
# OpenAI's own limit per embeddings call; past --max-client-batch-size a call runs in consecutive slices.
MAX_INPUTS = 2048


class EmbeddingsBody(RequestBody):
    """Unknown fields are refused, as OpenAI's API does; the fields the openai SDK, LangChain and LlamaIndex send
    (input, model, dimensions, encoding_format, user) are OpenAI's own. Numbers and booleans are strict."""

    model_config = ConfigDict(extra="forbid")
    input: str | list[str] | list[int] | list[list[int]] | list[str | ContentPart | list[ContentPart]] | None = Field(
        None,
        description="A text, a list of texts, token ids, or a list of token-id lists (used as given); extension: "
        "a list whose items may be content parts (image_url data URLs, text) for models that take images, or "
        "lists of parts in the order the model reads them (one vector each; several images and text before an "
        "image for the vision-language embedders).",
    )
    messages: list[Message] | None = Field(
        None,
        description="vLLM's multimodal form instead of input: one message whose content is a text or a list of "
        "text and image_url parts in the order the model reads them; one embedding.",
    )
    model: str | None = Field(None, description="A served model name; empty or absent: the first served model.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(
        None, ge=1, description="Keep the first N dimensions (Matryoshka), then normalize."
    )
    user: str | None = None
    truncate: StrictBool | None = Field(
        None, description="Extension: cut inputs past the model's limit instead of refusing (unset: --auto-truncate)."
    )
    prompt_name: str | None = Field(
        None, description="Extension: a prompt of the model's sentence-transformers config."
    )
    task: str | None = Field(
        None,
        description="Extension: the task adapter to run with (the model's adapters, e.g. jina-embeddings-v3's "
        "retrieval.query), and that task's prompt unless prompt_name names one.",
    )
    normalize: StrictBool = Field(True, description="Extension: L2-normalize each vector.")
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
    bypass_cache: StrictBool = Field(
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
    `chunking: "mean"` (an extension, text inputs only) embeds texts past the model's limit by windows.
    Up to 2048 inputs per call, as OpenAI's own API takes."""
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
    items = _items_of(body)
    inputs = body.input if isinstance(body.input, list) else [body.input]
    if items is not None:
        _check_items(frontend, engine, items, params)
        result = await _in_slices(frontend, items, engine.embedding.embed, params)
    elif _is_token_ids(inputs):
        if params.chunking:
            raise InvalidInput("chunking applies to text inputs; token-id inputs are used as given")
        token_ids = [inputs] if isinstance(inputs[0], int) else inputs
        result = await _in_slices(frontend, _checked_count(token_ids), engine.embedding.embed_token_ids, params)
    else:
        texts = frontend.check_texts(_checked_count(inputs), "input")
        result = await _in_slices(frontend, texts, engine.embedding.embed, params)
    answered = result.chunks if result.chunks is not None else result.embeddings
    call_of(request).answered(len(answered), result.prompt_tokens, result.timing)
    if result.chunks is not None:
        rows = np.concatenate([rows for _, rows in result.chunks])
        data = chunk_items(result, vectors_json(rows, body.encoding_format))
    else:
        vectors = vectors_json(result.embeddings, body.encoding_format)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    response = {"object": "list", "data": data, "model": engine.info.name, "usage": usage}
    if result.encoding_scale:
        response["encoding_scale"] = result.encoding_scale
    return JSON(response)


def _items_of(body: EmbeddingsBody) -> list[EmbedInput] | None:
    """The call's texts and images when it sends content parts or messages; None for texts or token ids alone."""
    if (body.input is None) == (body.messages is None):
        raise InvalidInput("send input (texts, token ids or content parts) or messages, one of the two")
    if body.messages is not None:
        return [message_item(body.messages)]
    if isinstance(body.input, list) and any(_is_content(value) for value in body.input):
        return input_items(body.input)
    return None


def _is_content(value: object) -> bool:
    """A content part, or a list of them (token-id lists hold ints)."""
    if isinstance(value, list):
        return bool(value) and isinstance(value[0], (ImagePart, TextPart))
    return isinstance(value, (ImagePart, TextPart))


def _check_items(frontend: Frontend, engine: Engine, items: list, params: EmbedParams) -> None:
    """Texts and images: the images within the image limits, the texts within --max-input-chars."""
    _checked_count(items)
    frontend.check_images(engine, items)
    has_images = any(not isinstance(item, str) for item in items)
    if has_images and (params.chunking or params.late_chunking is not None):
        raise InvalidInput("chunking and late_chunking apply to texts only; send the images without them")
    frontend.check_item_chars(items, "input")


def _checked_count(inputs: list) -> list:
    if not inputs:
        raise InvalidInput("input is empty; send at least one text")
    if len(inputs) > MAX_INPUTS:
        raise InvalidInput(
            f"this endpoint takes at most {MAX_INPUTS} inputs per request; got {len(inputs)}: "
            "split them over several requests"
        )
    return inputs


async def _in_slices(frontend: Frontend, inputs: list, embed: Callable, params: EmbedParams) -> EmbedResult:
    """A call past --max-client-batch-size as consecutive engine calls within it, each admitted on its own (so
    --max-concurrent-requests still holds), merged in input order with their usage summed."""
    size = frontend.config.max_client_batch_size
    spans = params.late_chunking.spans if params.late_chunking is not None else ()
    if spans and len(spans) != len(inputs) and len(inputs) > size:
        raise InvalidInput(f"late_chunking.spans has {len(spans)} entries for {len(inputs)} inputs; give one per input")
    results = []
    for start in range(0, len(inputs), size):
        part = inputs[start : start + size]
        with frontend.limiter.hold(len(part)):
            results.append(await embed(part, _slice_of(params, start, start + size)))
    if len(results) == 1:
        return results[0]
    first = results[0]

    def joined(name: str):
        return None if getattr(first, name) is None else [x for r in results for x in getattr(r, name)]

    timing = Timing.summed([r.timing for r in results])
    return replace(
        first,
        embeddings=None if first.embeddings is None else np.concatenate([r.embeddings for r in results]),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        timing=timing,
        sparse=joined("sparse"),
        multi_vectors=joined("multi_vectors"),
        chunks=joined("chunks"),
    )


def _slice_of(params: EmbedParams, start: int, stop: int) -> EmbedParams:
    """The call's params for its inputs [start, stop): late chunking's per-input spans are sliced with them."""
    chunking = params.late_chunking
    if chunking is None or not chunking.spans:
        return params
    return replace(params, late_chunking=replace(chunking, spans=chunking.spans[start:stop]))


def vectors_json(rows: np.ndarray, encoding_format: str) -> list:
    """Each row as JSON takes it: a list of numbers, or with "base64" the base64 of its little-endian bytes."""
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
        "auto_truncate": info.auto_truncate,
        "modalities": [modality.value for modality in info.modalities],
        # vLLM's fields: a --lora adapter's parent (and root) is its base model; a base model is its own root.
        "root": info.base_model or info.name,
        "parent": info.base_model or None,
    }


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(request: Request):
    served = frontend_of(request).models
    cards = [model_card(e.info) for base in served.engines for e in (base, *served.lora_engines(base))]
    return JSON({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def retrieve_model(request: Request, model: str):
    return JSON(model_card(frontend_of(request).models.get(model).info))
