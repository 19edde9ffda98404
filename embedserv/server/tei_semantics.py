"""What TEI's two faces, gRPC (grpc/tei.py) and HTTP (http/tei.py), decide alike: a model's TEI kind, which
model scores a text pair, and tokens as TEI reports them."""

from __future__ import annotations

from typing import NamedTuple

from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.frontend import MODEL_HEADER, Frontend
from embedserv.types import ModelInfo, RerankMode, Task, TokenizedText


def model_kind(info: ModelInfo) -> str:
    """TEI's three kinds: a cross-encoder or yes/no reranker is a "reranker" (TEI's name for a one-label
    classifier), another classifier a "classifier", anything else (embedders; generators) an "embedding"."""
    if Task.RERANK in info.tasks and Task.EMBED not in info.tasks:
        return "reranker"
    if Task.CLASSIFY in info.tasks:
        return "classifier"
    return "embedding"


def scores_pairs(engine: Engine) -> bool:
    """A cross-encoder: one score for a (text, text) pair."""
    return engine.served.task.rerank_mode is RerankMode.PAIR


def pair_scorer(frontend: Frontend, name: str | None, carrier: str) -> Engine:
    """The named model, else the first served cross-encoder; refused unless it is a cross-encoder (the
    engine scores a pair only as a cross-encoder's rerank). `carrier`: "header" or "metadata key"."""
    scorers = [e for e in frontend.models.engines if scores_pairs(e)]
    engine = frontend.models.get(name) if name or not scorers else scorers[0]
    if not scores_pairs(engine):
        named = ", ".join(e.info.name for e in scorers) or "none is served here"
        raise InvalidInput(
            f"model {engine.info.name!r} cannot score a pair of texts: a cross-encoder does (served cross-encoders: "
            f"{named}), named with the {MODEL_HEADER} {carrier}. Send single texts to classify them"
        )
    return engine


class TeiToken(NamedTuple):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


def tei_tokens(engine: Engine, text: str, prompt_name: str | None, tokenized: TokenizedText) -> list[TeiToken]:
    """TEI's tokens: a special token's own text and no offsets; any other token's piece of the text the
    tokenizer read (the prompt and the text, lower-cased for models that ask) and its UTF-8 byte offsets in
    it, as TEI (Rust) reports them."""
    seen = engine.served.tokenizer.resolve_prompt(prompt_name) + text
    seen = seen.lower() if engine.served.tokenizer.do_lower_case else seen
    byte_at = [0]
    for char in seen:
        byte_at.append(byte_at[-1] + len(char.encode("utf-8", "surrogatepass")))
    return [
        TeiToken(i, token, True, None, None)
        if special
        else TeiToken(i, seen[start:stop], False, byte_at[start], byte_at[stop])
        for i, token, (start, stop), special in zip(
            tokenized.ids, tokenized.tokens, tokenized.offsets, tokenized.special, strict=True
        )
    ]
