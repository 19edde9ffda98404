"""Cohere's v2 API, as the cohere SDK's ClientV2 calls it: POST /v2/embed and POST /v2/rerank.

/v2/embed: `texts`, `images` (data URIs, for models that take images) or `inputs` (each `{"content": [parts]}`:
a text part, an image_url part, or an image_url part then a text part, one vector for the image with its text, for
models that take text with an image; image_inputs.content_item); `input_type` picks the model's prompt
configured for it (--input-type-prompt, the model's input_types key), else its prompt of that name, else its query
prompt for search_query and its document / passage prompt for search_document (none: the model's default
prompt); `embedding_types` asks for any of float, int8, uint8, binary, ubinary and base64 (float32 bytes) from one
forward pass (int8 / uint8 are the codes of our int8 / uint8 encodings, whose raw integer dot products rank as the
floats do); `output_dimension` keeps the first N dimensions (Matryoshka); `truncate` NONE refuses a text past the
model's limit, START cuts its start, END (the default) its end.
/v2/rerank: `query`, `documents` (texts), `top_n`; documents past the model's limit are cut, as Cohere cuts them.
Errors come in Cohere's shape ({"message": ...}) with the statuses the SDK maps to its exceptions (400, 401, 404,
429, 503).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field, StrictStr

from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body, RequestBody, call_of, engine_for_task, engine_named, frontend_of
from embedserv.server.http.error_responses import JSON
from embedserv.server.http.image_inputs import ContentPart, content_item, image_of_url
from embedserv.server.http.openai import vectors_json
from embedserv.server.http.scoring import rerank_documents
from embedserv.types import (
    EmbedParams,
    Encoding,
    ImageInput,
    InterleavedInput,
    ModelInfo,
    RerankParams,
    Task,
    TruncationDirection,
)

router = APIRouter(tags=["Cohere v2"])

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
_ENCODINGS = {
    "float": Encoding.FLOAT32, "base64": Encoding.FLOAT32, "int8": Encoding.INT8, "uint8": Encoding.UINT8,
    "binary": Encoding.BINARY, "ubinary": Encoding.UBINARY,
}  # fmt: skip
# The model's prompts an input_type takes, in order of preference, unless its input_types configure one.
_PROMPTS = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
    "image": (),
}


class EmbedInput(Body):
    content: list[ContentPart] = Field(description="Text and image_url parts in the order the model reads them.")


class EmbedV2Request(RequestBody):
    model: str | None = Field(None, description="A served model name; absent: the first served model.")
    texts: list[StrictStr] | None = Field(None, description="The texts to embed (or images).")
    images: list[StrictStr] | None = Field(None, description="Images as data URIs, for models that take images.")
    inputs: list[EmbedInput] | None = Field(None, description="Inputs of content parts (or texts or images).")
    input_type: InputType | None = Field(None, description="Picks the model's prompt for the inputs' role.")
    embedding_types: list[EmbeddingType] = Field(["float"], min_length=1, description="The encodings to return.")
    output_dimension: int | None = Field(None, ge=1, description="Keep the first N dimensions (Matryoshka).")
    truncate: Literal["NONE", "START", "END"] = Field("END", description="NONE refuses texts past the limit.")


class RerankV2Request(RequestBody):
    model: str | None = Field(None, description="A served model name; absent: the first that reranks.")
    query: StrictStr
    documents: list[StrictStr]
    top_n: int | None = Field(None, ge=1, description="Keep the best N results; absent: all.")


def prompt_for(info: ModelInfo, input_type: str | None) -> str | None:
    """The model's prompt for `input_type`: the configured one, else the first of _PROMPTS' it has, else None
    (its default prompt, if it has one)."""
    configured = dict(info.input_type_prompts)
    if input_type in configured:
        return configured[input_type]
    for name in _PROMPTS.get(input_type or "", ()):
        if name in info.prompt_names:
            return name
    return None


def _inputs(body: EmbedV2Request) -> tuple[str, list[str | ImageInput | InterleavedInput]]:
    given = [name for name in ("texts", "images", "inputs") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidInput(
            f"send texts, images or inputs, one of the three (the call sends {' and '.join(given) or 'none'})"
        )
    if body.texts is not None:
        return "texts", list(body.texts)
    if body.inputs is not None:
        return "inputs", [content_item(item.content, f"inputs[{i}]") for i, item in enumerate(body.inputs)]
    return "images", [image_of_url(url, f"images[{i}]") for i, url in enumerate(body.images or ())]


@router.post("/v2/embed")
async def embed(request: Request, body: EmbedV2Request):
    """Cohere v2 embed: every asked encoding of each input's vector, from one forward pass."""
    frontend = frontend_of(request)
    engine = engine_named(request, body.model)
    field, inputs = _inputs(body)
    frontend.check_items(engine, inputs, field)
    params = EmbedParams(
        truncate=body.truncate != "NONE",
        truncation_direction=TruncationDirection.LEFT if body.truncate == "START" else TruncationDirection.RIGHT,
        dimensions=body.output_dimension,
        prompt_name=prompt_for(engine.info, body.input_type),
    )
    with frontend.limiter.hold(len(inputs)):
        floats = await engine.embedding.embed(inputs, params)
        embeddings = {}
        for kind in dict.fromkeys(body.embedding_types):
            encoding = _ENCODINGS[kind]
            result = floats
            if encoding is not Encoding.FLOAT32:
                result = await engine.embedding.in_encoding(replace(floats), replace(params, encoding=encoding))
            embeddings[kind] = vectors_json(result.embeddings, "base64" if kind == "base64" else "float")
    call_of(request).answered(len(inputs), floats.prompt_tokens, floats.timing)
    response: dict = {
        "id": f"embed-{call_of(request).request_id}",
        "embeddings": embeddings,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": floats.prompt_tokens}},
        "response_type": "embeddings_by_type",
    }
    if field == "texts":
        response["texts"] = inputs
    return JSON(response)


@router.post("/v2/rerank")
async def rerank(request: Request, body: RerankV2Request):
    """Cohere v2 rerank: each document's relevance to the query, best first."""
    engine = engine_for_task(request, Task.RERANK, body.model)
    frontend_of(request).check_rerank(engine, body.query, body.documents)
    params = RerankParams(top_n=body.top_n, truncate=True)
    result = await rerank_documents(request, engine, body.query, body.documents, params)
    return JSON(
        {
            "id": f"rerank-{call_of(request).request_id}",
            "results": [{"index": r.index, "relevance_score": r.score} for r in result.results],
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
        }
    )
