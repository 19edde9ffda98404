"""The bodies and answers of text-embeddings-inference's HTTP API (router/src/http/types.rs), as pydantic
models for validation and /openapi.json, and the helpers that turn TEI's loose input shapes into lists.

Defaults are TEI's: normalize and add_special_tokens and skip_special_tokens true, truncate the server's
--auto-truncate (false unless set, as TEI's), truncation_direction right. TEI accepts `Left`/`left`; we accept any case.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StrictBool, StrictStr, WithJsonSchema

from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body, RequestBody
from embedserv.server.http.error_responses import HttpError
from embedserv.types import TruncationDirection


def _direction(value: str) -> TruncationDirection:
    try:
        return TruncationDirection(value.lower())
    except ValueError:
        raise ValueError(f"must be right or left, not {value!r}") from None


def _json_int(value):
    """JSON Schema's integer: 3 and 3.0, not "3" or true (which pydantic's lax int takes)."""
    if isinstance(value, (str, bool)):
        raise ValueError("must be an integer")
    return value


# Bodies take JSON's types as their schema says: strict strings and booleans, integers as _json_int.
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_json_int)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_json_int)]
_DIRECTIONS = ["right", "left", "Right", "Left", "RIGHT", "LEFT"]
Direction = Annotated[
    str, AfterValidator(_direction), WithJsonSchema({"type": "string", "enum": _DIRECTIONS, "description": "any case"})
]
_TRUNCATE = (
    "Cut inputs longer than the model's limit instead of refusing them (null: the server's --auto-truncate, "
    "false unless set, as TEI)"
)
TokenIds = list[NonNegativeInt]
CHUNKING = (
    "An embedserv extra: max scores a document that does not fit beside the query by its best window (windows of "
    "the model's limit) instead of cutting or refusing it; the document is still returned whole"
)
# Documented, not enforced: an empty batch or query gets the route's own answer (TEI's 400 "empty"), while
# schema-driven clients and fuzzers learn not to send one.
NON_EMPTY = {"minItems": 1}
NonEmptyText = Annotated[StrictStr, WithJsonSchema({"type": "string", "minLength": 1})]
# One text or a pair (documented; predict_sequences says what is wrong with a longer one).
Sequence = Annotated[
    list[StrictStr], WithJsonSchema({"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2})
]


class TeiEmbedAllRequest(RequestBody):
    """/embed_all's body, and /embed_sparse's; /embed's adds normalize and dimensions."""

    inputs: StrictStr | TokenIds | list[StrictStr | TokenIds] = Field(
        description="A text, a list of token ids, or a batch of texts and token-id lists", json_schema_extra=NON_EMPTY
    )
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    truncation_direction: Direction = TruncationDirection.RIGHT
    prompt_name: str | None = Field(None, description="A prompt of the model's sentence-transformers config")


class TeiEmbedSparseRequest(TeiEmbedAllRequest):
    pass


class TeiEmbedRequest(TeiEmbedAllRequest):
    normalize: StrictBool = True
    dimensions: PositiveInt | None = Field(None, description="Keep the first N dimensions (Matryoshka)")


class TeiSimilarityInput(Body):
    source_sentence: StrictStr = Field(
        description="The text the others are compared with", examples=["What is Deep Learning?"]
    )
    sentences: list[StrictStr] = Field(
        description="The texts compared with source_sentence", json_schema_extra=NON_EMPTY,
        examples=[["What is Machine Learning?"]],
    )  # fmt: skip


class TeiSimilarityParameters(Body):
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    truncation_direction: Direction = TruncationDirection.RIGHT
    prompt_name: str | None = Field(None, description="A prompt of the model's sentence-transformers config")


class TeiSimilarityRequest(RequestBody):
    """/similarity's body (TEI's and huggingface_hub's sentence-similarity input)."""

    inputs: TeiSimilarityInput
    parameters: TeiSimilarityParameters | None = None


class TeiPredictRequest(RequestBody):
    inputs: StrictStr | Sequence | list[Sequence] = Field(
        description="A text, a pair [text, text], or a batch of single texts and pairs [[text], [text, text]]",
        json_schema_extra=NON_EMPTY,
    )
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    truncation_direction: Direction = TruncationDirection.RIGHT
    raw_scores: StrictBool = False


class TeiRerankRequest(RequestBody):
    query: NonEmptyText
    texts: list[StrictStr] = Field(json_schema_extra=NON_EMPTY)
    truncate: StrictBool | None = Field(None, description=_TRUNCATE)
    truncation_direction: Direction = TruncationDirection.RIGHT
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    chunking: Literal["max"] | None = Field(None, description=CHUNKING)


class TeiTokenizeRequest(RequestBody):
    inputs: StrictStr | list[StrictStr] = Field(json_schema_extra=NON_EMPTY)
    add_special_tokens: StrictBool = True
    prompt_name: str | None = None


class TeiDecodeRequest(RequestBody):
    ids: TokenIds | list[TokenIds] = Field(description="One list of token ids, or a batch of them")
    skip_special_tokens: StrictBool = True


class TeiError(BaseModel):
    error: str
    error_type: str = Field(description="validation, tokenizer, overloaded, unhealthy, backend or empty")


class TeiPrediction(BaseModel):
    score: float
    label: str


class TeiSparseValue(BaseModel):
    index: int = Field(description="A vocabulary id")
    value: float


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = Field(None, description="The text, when return_text is true")


class TeiToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="UTF-8 byte offset in the input (prompt included); null if special")
    stop: int | None


class TeiEmbeddingModel(BaseModel):
    pooling: str


class TeiClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TeiModelType(BaseModel):
    """Exactly one of the three, as TEI's ModelType enum serializes."""

    embedding: TeiEmbeddingModel | None = None
    classifier: TeiClassifierModel | None = None
    reranker: TeiClassifierModel | None = None


class TeiInfo(BaseModel):
    model_id: str
    model_sha: str | None
    model_dtype: str
    served_model_name: str
    model_type: TeiModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None


def require_some(items: list, what: str) -> None:
    """TEI answers an empty batch 400 (its "empty" error), where other invalid input is 422."""
    if not items:
        raise HttpError(400, f"`{what}` cannot be empty; send at least one")


def embed_inputs(inputs) -> list[str | list[int]]:
    """TEI's Input: a text or one token-id list is a batch of one."""
    if isinstance(inputs, str) or (inputs and all(isinstance(x, int) for x in inputs)):
        return [inputs]
    return list(inputs)


def predict_sequences(inputs) -> tuple[bool, list[list[str]]]:
    """TEI's PredictInput as (is one input, sequences of one text or a pair): "a" and ["a"] are one text,
    ["a", "b"] one pair, [["a"], ["a", "b"]] a batch; anything longer than a pair is refused."""
    if isinstance(inputs, str):
        return True, [[inputs]]
    if inputs and all(isinstance(x, str) for x in inputs):
        sequences, single = [list(inputs)], True
    else:
        sequences, single = [list(x) for x in inputs], False
    for index, sequence in enumerate(sequences):
        if not 1 <= len(sequence) <= 2:
            where = "inputs" if single else f"inputs[{index}]"
            raise InvalidInput(f"{where} has {len(sequence)} texts; a sequence is one text or a pair of two")
    return single, sequences


def check_direction(direction: TruncationDirection, truncate: bool, what: str) -> None:
    """Pairs are cut by the rerank tokenizer's own rule (the document's end); say so instead of ignoring it."""
    if truncate and direction is TruncationDirection.LEFT:
        raise InvalidInput(
            f"truncation_direction left is not supported for {what}; pairs are cut at the end of their second "
            "text. Use right, or send shorter texts"
        )
