"""ClassifyTokens for Client and AsyncClient: the request fields, the plan, and what comes back (each input's
tokens with their label, score and character span, and the entities transformers' token-classification
pipeline would give)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embedserv_client import plans
from embedserv_client.v1 import embedserv_pb2 as pb

# transformers' aggregation_strategy names.
AGGREGATIONS = {
    "none": pb.AGGREGATION_NONE,
    "simple": pb.AGGREGATION_SIMPLE,
    "first": pb.AGGREGATION_FIRST,
    "average": pb.AGGREGATION_AVERAGE,
    "max": pb.AGGREGATION_MAX,
}


@dataclass(frozen=True)
class TokenLabel:
    """One non-special token: its position among the input's tokens, its text, input[start:end], its best label
    and probability, and (all_scores) every label's probability in the model's label order."""

    index: int
    token: str
    start: int
    end: int
    label: str
    score: float
    scores: tuple[float, ...] = ()


@dataclass(frozen=True)
class Entity:
    """A token (aggregation "none": `index` set) or a group of tokens or words (`label` without its B-/I-)."""

    label: str
    score: float
    word: str
    start: int
    end: int
    index: int | None = None


@dataclass(frozen=True)
class TokenClassification:
    tokens: list[TokenLabel]
    entities: list[Entity]

    @classmethod
    def from_proto(cls, message: pb.TokenClassification) -> TokenClassification:
        tokens = [
            TokenLabel(t.index, t.token, t.start, t.end, t.label, t.score, tuple(t.scores)) for t in message.tokens
        ]
        entities = [
            Entity(e.label, e.score, e.word, e.start, e.end, e.index if e.HasField("index") else None)
            for e in message.entities
        ]
        return cls(tokens, entities)


def token_classify_fields(
    model: str,
    aggregation: str,
    ignore_labels: Sequence[str] | None,
    all_scores: bool,
    truncate: bool | None,
    truncation_direction: str,
) -> dict:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, not {aggregation!r}")
    fields = dict(
        model=model,
        aggregation=AGGREGATIONS[aggregation],
        all_scores=all_scores,
        truncate=truncate,
        truncation_direction=plans.direction(truncation_direction),
    )
    if ignore_labels is not None:
        if isinstance(ignore_labels, str):
            ignore_labels = [ignore_labels]
        fields["ignore_labels"] = pb.LabelList(labels=plans.strings(list(ignore_labels), "ignore_labels"))
    return fields


def classify_tokens_plan(texts: list[str], size: int, single: bool, **fields) -> plans.Plan:
    """Each text's answer depends on it alone, so the parts simply concatenate."""
    requests = [pb.ClassifyTokensRequest(inputs=part, **fields) for part in plans.chunks(texts, size)]

    def merge(replies: list[pb.ClassifyTokensResponse]) -> TokenClassification | list[TokenClassification]:
        results = [TokenClassification.from_proto(c) for reply in replies for c in reply.inputs]
        return results[0] if single else results

    return plans.Plan("ClassifyTokens", requests, merge, min(size, len(texts)))
