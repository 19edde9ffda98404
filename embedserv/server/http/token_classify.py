"""POST /v1/classify_tokens: token classification (NER, PII tagging) of *ForTokenClassification models.

Neither OpenAI, vLLM (its `token_classify` pooling task answers raw per-token arrays on /pooling) nor TEI has a
route for it, so the body follows our /v1/classify (vLLM's classify): `input` (a text or texts), `model`,
`truncate`, plus transformers' pipeline("token-classification") options `aggregation_strategy` and
`ignore_labels`. The answer's entities are the pipeline's dicts as it returns them ({entity, score, index,
word, start, end} per token with "none"; {entity_group, score, word, start, end} per group otherwise), so
code written against the pipeline reads them as they are; each input's `tokens` lists every non-special
token's label, score and character span (`scores`: every label's probability, with all_scores):

    {id, object: "list", created, model, data: [{index, tokens: [...], entities: [...]}], usage}

Errors are OpenAI-shaped, 400 for a bad body, as the other /v1 routes answer.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field, StrictBool, StrictStr
from starlette.requests import Request

from embedserv.engine.tasks.entities import DEFAULT_IGNORE_LABELS, Aggregation, Entity, TokenScores
from embedserv.engine.tasks.token_classification import TokenClassifyParams
from embedserv.server.http.common import RequestBody, call_of, engine_for_task, frontend_of
from embedserv.server.http.scoring import OPENAI_ERRORS, list_answer
from embedserv.server.http.scoring_models import TokenUsage
from embedserv.server.http.tei_models import NON_EMPTY
from embedserv.types import Task

router = APIRouter(tags=["rerank, classify, score"], responses=OPENAI_ERRORS)

_STRATEGY = (
    "transformers' aggregation_strategy: none (one entity per token), simple (adjacent tokens of one tag), or "
    "first / average / max (simple over words, each word labelled by its first token, its tokens' mean "
    "probabilities, or its most confident token)"
)
_IGNORE = "Entities with these labels are left out (none: a token's label; else a group's); unset: [\"O\"]"


class ClassifyTokensRequest(RequestBody):
    model: str | None = Field(None, description="A served model's name; unset: the first token classifier")
    input: StrictStr | list[StrictStr] = Field(json_schema_extra=NON_EMPTY)
    aggregation_strategy: Literal["none", "simple", "first", "average", "max"] = Field("none", description=_STRATEGY)
    ignore_labels: list[StrictStr] | None = Field(None, description=_IGNORE)
    all_scores: StrictBool = Field(False, description="Each token also lists every label's probability")
    truncate: StrictBool | None = Field(
        None, description="Cut inputs longer than the model's limit instead of refusing them"
    )


class TokenLabelData(BaseModel):
    index: int = Field(description="Position among the input's tokens, special tokens included")
    token: str
    start: int
    end: int
    label: str
    score: float
    scores: list[float] | None = Field(None, description="With all_scores: every label's probability, model order")


class ClassifyTokensData(BaseModel):
    index: int
    tokens: list[TokenLabelData] = Field(description="Every non-special token")
    entities: list[dict] = Field(description="transformers' pipeline dicts")


class ClassifyTokensResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyTokensData]
    usage: TokenUsage


@router.post("/v1/classify_tokens", response_model=ClassifyTokensResponse)
async def classify_tokens(request: Request, body: ClassifyTokensRequest):
    """A label per token and the entities transformers' token-classification pipeline gives."""
    engine = engine_for_task(request, Task.TOKEN_CLASSIFY, body.model)
    frontend = frontend_of(request)
    texts = frontend.check_inputs([body.input] if isinstance(body.input, str) else body.input, "input")
    strategy = Aggregation(body.aggregation_strategy)
    params = TokenClassifyParams(
        aggregation=strategy,
        ignore_labels=DEFAULT_IGNORE_LABELS if body.ignore_labels is None else tuple(body.ignore_labels),
        truncate=body.truncate,
    )
    with frontend.limiter.hold(len(texts)):
        result = await engine.token_classification.classify_tokens(texts, params)
    call_of(request).answered(len(texts), result.prompt_tokens, result.timing)
    data = [
        {
            "index": index,
            "tokens": [_token(token, result.labels, body.all_scores) for token in tokens],
            "entities": [_entity(entity, strategy) for entity in entities],
        }
        for index, (tokens, entities) in enumerate(zip(result.tokens, result.entities, strict=True))
    ]
    return list_answer(request, "classify-tokens", engine.info.name, data, result.prompt_tokens)


def _token(token: TokenScores, labels: tuple[str, ...], all_scores: bool) -> dict:
    best = token.best
    item = {
        "index": token.index,
        "token": token.word,
        "start": token.start,
        "end": token.end,
        "label": labels[best],
        "score": float(token.scores[best]),
    }
    if all_scores:
        item["scores"] = token.scores.tolist()
    return item


def _entity(entity: Entity, strategy: Aggregation) -> dict:
    """The pipeline's dict: `entity` and `index` per token (none), `entity_group` per group."""
    if strategy is Aggregation.NONE:
        return {
            "entity": entity.label,
            "score": entity.score,
            "index": entity.index,
            "word": entity.word,
            "start": entity.start,
            "end": entity.end,
        }
    return {
        "entity_group": entity.label,
        "score": entity.score,
        "word": entity.word,
        "start": entity.start,
        "end": entity.end,
    }
