"""Classify: every label's score per input from the model's classifier head, or, with candidate labels,
those labels' zero-shot scores from an NLI model (zero_shot.py)."""

from __future__ import annotations

import time

from embedserv.engine import checks
from embedserv.engine.inputs import pairs
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks import zero_shot
from embedserv.engine.tasks.outputs import activate, stack_rows
from embedserv.errors import InvalidInput
from embedserv.types import Activation, ClassifyParams, ClassifyResult, Task


class Classification:
    def __init__(self, core: Core, served: ServedModel) -> None:
        self._core = core
        self._served = served

    async def classify(self, texts: list[str], params: ClassifyParams) -> ClassifyResult:
        """Every label's score per input; with candidate_labels, those labels' zero-shot scores (an NLI model)."""
        received = time.perf_counter()
        params = checks.with_truncate(self._served.info, params)
        checks.require(self._served.info, Task.CLASSIFY, "Classify")
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        checks.check_direction(params.truncation_direction)
        zero_shot.check_options(params.candidate_labels, params.hypothesis_template, params.multi_label)
        if params.candidate_labels:
            return await self._classify_zero_shot(texts, params, received)
        encoded = await self._core.tokenize_with(
            self._served.tokenizer.encode_batch,
            texts,
            params.truncate,
            params.truncation_direction,
            None,
            chars=sum(map(len, texts)),
        )
        outputs, prompt_tokens, timing = await self._core.infer(encoded, received)
        logits = stack_rows(outputs)
        task = self._served.task
        if not params.raw_scores:
            single = logits.shape[1] == 1 or task.multi_label
            logits = activate(logits, Activation.SIGMOID if single else Activation.SOFTMAX)
        return ClassifyResult(scores=logits, labels=task.labels, prompt_tokens=prompt_tokens, timing=timing)

    async def _classify_zero_shot(self, texts: list[str], params: ClassifyParams, received: float) -> ClassifyResult:
        """transformers' zero-shot-classification pipeline: one scheduler request per (input, label) pair,
        input-major, so the pairs batch with every other call's sequences."""
        entailment = zero_shot.require_entailment(self._served.task.labels, self._served.info.name)
        hypotheses = zero_shot.hypotheses(params.candidate_labels, params.hypothesis_template)
        encoded = await self._core.tokenize_with(
            pairs.encode_premise_pairs,
            self._served.tokenizer,
            texts,
            hypotheses,
            params.truncate,
            params.truncation_direction,
        )
        outputs, prompt_tokens, timing = await self._core.infer(encoded, received)
        scores = zero_shot.label_scores(
            stack_rows(outputs), len(texts), entailment, params.multi_label, params.raw_scores
        )
        return ClassifyResult(
            scores=scores, labels=tuple(params.candidate_labels), prompt_tokens=prompt_tokens, timing=timing
        )
