"""ClassifyTokens: a *ForTokenClassification model's label and probabilities for every token of each input, and
the entities transformers' token-classification pipeline would give (entities.py).

The worker's token head gives each token's logits as the sequence's token vectors (models/heads/
token_classifier.py); here they become probabilities (softmax, as the pipeline) and entities, with character
offsets from the tokenizer's offset mapping. Special tokens are left out, as the pipeline leaves them out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from embedserv.engine import checks
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks.entities import (
    DEFAULT_IGNORE_LABELS,
    Aggregation,
    Entity,
    TokenScores,
    aggregate,
    softmax,
    token_scores,
)
from embedserv.errors import InvalidInput
from embedserv.types import EmbedOutput, Task, Timing, TruncationDirection


@dataclass(frozen=True)
class TokenClassifyParams:
    # The pipeline's aggregation_strategy.
    aggregation: Aggregation = Aggregation.NONE
    # Entities with these labels (NONE: a token's label; otherwise a group's, without B-/I-) are left out.
    ignore_labels: tuple[str, ...] = DEFAULT_IGNORE_LABELS
    # None: the model's default (ModelInfo.auto_truncate).
    truncate: bool | None = None
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT


@dataclass
class TokenClassifyResult:
    # Per input, in order: its non-special tokens (each with every label's probability) and its entities.
    tokens: list[list[TokenScores]]
    entities: list[list[Entity]]
    # The model's label names, in the order of each token's probabilities.
    labels: tuple[str, ...]
    prompt_tokens: int
    timing: Timing = field(default_factory=Timing)


class TokenClassification:
    def __init__(self, core: Core, served: ServedModel) -> None:
        self._core = core
        self._info = served.info
        self._labels = served.task.labels
        self._tokenizer = served.tokenizer

    async def classify_tokens(self, texts: list[str], params: TokenClassifyParams) -> TokenClassifyResult:
        received = time.perf_counter()
        params = checks.with_truncate(self._info, params)
        checks.require(self._info, Task.TOKEN_CLASSIFY, "ClassifyTokens")
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        checks.check_direction(params.truncation_direction)
        tokenized = await self._core.tokenize_with(
            self._tokenizer.encode_with_offsets,
            texts,
            params.truncate,
            params.truncation_direction,
            chars=sum(map(len, texts)),
        )
        sequences = [InputSequence(ids=t.ids) for t in tokenized]
        outputs, prompt_tokens, timing = await self._core.infer(sequences, received, (EmbedOutput.MULTI_VECTOR,))
        word_aware = self._tokenizer.is_word_aware
        unk_id = self._tokenizer.hf_tokenizer.unk_token_id
        tokens = [
            token_scores(text, t.tokens, t.ids, t.offsets, t.special, softmax(out.vectors), word_aware, unk_id)
            for text, t, out in zip(texts, tokenized, outputs, strict=True)
        ]
        entities = [
            aggregate(
                input_tokens, self._labels, params.aggregation, params.ignore_labels, self._tokenizer.tokens_to_string
            )
            for input_tokens in tokens
        ]
        return TokenClassifyResult(tokens, entities, self._labels, prompt_tokens, timing)
