"""Token classification's entities, as transformers' `pipeline("token-classification")` (5.x) makes them.

Torch-free: the per-token probabilities come in as numpy rows. The steps are the pipeline's own:
- `token_scores` (its gather_pre_entities): every non-special token with its probabilities, character span and
  whether it continues the word before it. Word-aware tokenizers (a model with a continuing-subword prefix,
  WordPiece's `##`) say so by the token's length against its text's; others fall back to the pipeline's
  heuristic (no space just before the token's start). An unknown token takes its text as its word, and starts
  a word.
- `aggregate` (its aggregate + the ignore_labels filter): NONE keeps one entity per token, labelled with the
  token's best label; SIMPLE groups adjacent tokens whose labels share a tag (B-X starts a new group, I-X
  continues it, a label without B-/I- continues); FIRST, AVERAGE and MAX first give every word one label (its
  first token's best; the best of its tokens' averaged probabilities; the best label of its most confident
  token) and then group words as SIMPLE groups tokens. A group's score is the mean of its members' scores, its
  label the first member's without the B-/I- prefix, its word the tokenizer's string of the members' words.
- Entities whose label is in `ignore_labels` (the pipeline's default: "O") are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from embedserv.types import ValueEnum


class Aggregation(ValueEnum):
    """The pipeline's aggregation_strategy."""

    NONE = "none"
    SIMPLE = "simple"
    FIRST = "first"
    AVERAGE = "average"
    MAX = "max"


# The pipeline's default ignore_labels.
DEFAULT_IGNORE_LABELS = ("O",)


@dataclass(frozen=True)
class TokenScores:
    """One non-special token of an input: the pipeline's pre-entity."""

    # Position among the input's tokens, special tokens included.
    index: int
    # The vocabulary token (`##ing`, `Ġword`), or for the unknown token the text it covers.
    word: str
    # Character span in the input: text[start:end].
    start: int
    end: int
    # It continues the word of the token before it (FIRST / AVERAGE / MAX join them).
    is_subword: bool
    # [num_labels] float32 probabilities (softmax of the token's logits), in the model's label order.
    scores: np.ndarray

    @property
    def best(self) -> int:
        return int(self.scores.argmax())


@dataclass(frozen=True)
class Entity:
    """An entry of the pipeline's answer: one token (NONE) or a group of tokens or words (the others)."""

    # The token's label (NONE), or the group's label without its B-/I- prefix (the pipeline's entity_group).
    label: str
    score: float
    word: str
    start: int
    end: int
    # NONE: the token's position among the input's tokens, special ones included; None for groups.
    index: int | None = None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Per row, in float32, as the pipeline computes it: exp(x - max) / sum."""
    logits = logits.astype(np.float32, copy=False)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def token_scores(
    text: str,
    tokens: Sequence[str],
    ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    special: Sequence[bool],
    scores: np.ndarray,
    word_aware: bool,
    unk_id: int | None,
) -> list[TokenScores]:
    """The non-special tokens of one input (`text`, as sent) with their probabilities `scores` [tokens, labels]."""
    out = []
    for index, (token, token_id, (start, end), is_special) in enumerate(
        zip(tokens, ids, offsets, special, strict=True)
    ):
        if is_special:
            continue
        covered = text[start:end]
        # Word-aware: a continuing piece is longer than its text (`##`); else: no space just before the token.
        guessed = start > 0 and " " not in text[start - 1 : start + 1]
        is_subword = len(token) != len(covered) if word_aware else guessed
        if token_id == unk_id:
            token, is_subword = covered, False
        out.append(TokenScores(index, token, start, end, is_subword, scores[index]))
    return out


def aggregate(
    tokens: list[TokenScores],
    labels: Sequence[str],
    strategy: Aggregation,
    ignore_labels: Sequence[str] = DEFAULT_IGNORE_LABELS,
    tokens_to_string: Callable[[list[str]], str] = " ".join,
) -> list[Entity]:
    """The input's entities under `strategy`, without those labelled with one of `ignore_labels`.
    `tokens_to_string` is the tokenizer's convert_tokens_to_string (its decoder over the tokens)."""
    if strategy in (Aggregation.NONE, Aggregation.SIMPLE):
        entities = [
            Entity(labels[t.best], float(t.scores[t.best]), t.word, t.start, t.end, index=t.index) for t in tokens
        ]
    else:
        entities = [_word_entity(word, labels, strategy, tokens_to_string) for word in _words(tokens)]
    if strategy is not Aggregation.NONE:
        entities = [_group(group, tokens_to_string) for group in _tag_groups(entities)]
    ignored = set(ignore_labels)
    return [entity for entity in entities if entity.label not in ignored]


def _words(tokens: list[TokenScores]) -> list[list[TokenScores]]:
    """Runs of a token and the subword tokens after it (the first token starts a word whatever it is)."""
    words: list[list[TokenScores]] = []
    for token in tokens:
        if words and token.is_subword:
            words[-1].append(token)
        else:
            words.append([token])
    return words


def _word_entity(
    word: list[TokenScores], labels: Sequence[str], strategy: Aggregation, tokens_to_string: Callable[[list[str]], str]
) -> Entity:
    if strategy is Aggregation.FIRST:
        scores = word[0].scores
    elif strategy is Aggregation.MAX:
        # The first token with the highest probability of any label (Python's max keeps the first).
        scores = max(word, key=lambda token: token.scores.max()).scores
    elif strategy is Aggregation.AVERAGE:
        scores = np.nanmean(np.stack([token.scores for token in word]), axis=0)
    else:
        raise ValueError(f"{strategy} does not aggregate words")
    best = int(scores.argmax())
    text = tokens_to_string([token.word for token in word])
    return Entity(labels[best], float(scores[best]), text, word[0].start, word[-1].end)


def _tag(label: str) -> tuple[str, str]:
    """(B or I, tag): B-X and I-X by their prefix; any other label continues (I) a group of its own name."""
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def _tag_groups(entities: list[Entity]) -> list[list[Entity]]:
    """Adjacent entities of one tag; a B- label starts a new group."""
    groups: list[list[Entity]] = []
    for entity in entities:
        if groups:
            bi, tag = _tag(entity.label)
            if tag == _tag(groups[-1][-1].label)[1] and bi != "B":
                groups[-1].append(entity)
                continue
        groups.append([entity])
    return groups


def _group(entities: list[Entity], tokens_to_string: Callable[[list[str]], str]) -> Entity:
    """The pipeline's group_sub_entities: the first label after its first '-', the mean score."""
    return Entity(
        label=entities[0].label.split("-", 1)[-1],
        score=float(np.nanmean([entity.score for entity in entities])),
        word=tokens_to_string([entity.word for entity in entities]),
        start=entities[0].start,
        end=entities[-1].end,
    )
