"""Bodies and answers of the rerank (Cohere / Jina / vLLM), classify and score (vLLM) routes, as pydantic
models for validation and /openapi.json. Unknown fields are ignored (Cohere's rank_fields or
max_tokens_per_doc, vLLM's truncate_prompt_tokens, `user`, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, StrictBool, StrictStr

from embedserv.server.http.common import Body, RequestBody
from embedserv.server.http.image_inputs import ContentPart
from embedserv.server.http.tei_models import CHUNKING, NON_EMPTY, NonEmptyText, NonNegativeInt

_MODEL = "A served model's name; unset: the x-embedserv-model header's, else the first that serves the task"
_TRUNCATE = (
    "Cut inputs longer than the model's limit instead of refusing them (an embedserv extra; unset: the server's "
    "--auto-truncate)"
)
_RAW = "Logits instead of the model's activation (an embedserv extra)"
Texts = StrictStr | list[StrictStr]


class RerankDocument(Body):
    text: StrictStr


class RerankContent(Body):
    """vLLM's multimodal score input: a text part, an image_url part, or an image_url part then a text part."""

    content: list[ContentPart]


class RerankRequest(RequestBody):
    model: str | None = Field(None, description=_MODEL)
    query: NonEmptyText | RerankContent = Field(
        description="A text; or {content: [parts]}, an image (then its text) for models that take image queries"
    )
    documents: list[StrictStr | RerankDocument | RerankContent] = Field(
        description="Texts, objects with a `text`, or {content: [parts]} (vLLM's form): an image_url part, then a text "
        "part if any, for models that take images",
        json_schema_extra=NON_EMPTY,
    )
    top_n: NonNegativeInt | None = Field(None, description="Keep the best N results; unset or 0: all (vLLM's 0)")
    return_documents: StrictBool = Field(
        True, description="Echo each document as {text} (Jina's and vLLM's default; Cohere's is false)"
    )
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    raw_scores: StrictBool = Field(False, description=_RAW)
    instruction: str | None = Field(None, description="The task instruction of instruction-following rerankers")
    chunking: Literal["max"] | None = Field(None, description=CHUNKING)


class ClassifyRequest(RequestBody):
    model: str | None = Field(None, description=_MODEL)
    input: Texts = Field(json_schema_extra=NON_EMPTY)
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    raw_scores: StrictBool = Field(False, description=_RAW)


class ScoreRequest(RequestBody):
    model: str | None = Field(None, description=_MODEL)
    text_1: NonEmptyText | list[NonEmptyText] = Field(
        description="One text (scored against every text_2) or as many texts as text_2", json_schema_extra=NON_EMPTY
    )
    text_2: Texts = Field(json_schema_extra=NON_EMPTY)
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    raw_scores: StrictBool = Field(False, description=_RAW)


class TokenUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


class RerankResultDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankResultDocument | None = Field(None, description="With return_documents; never an image")


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult] = Field(description="Best first")
    usage: TokenUsage


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float] = Field(description="Every label's probability (logits with raw_scores), model order")
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyData]
    usage: TokenUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData] = Field(description="In pair order")
    usage: TokenUsage


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
