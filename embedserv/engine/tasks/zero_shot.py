"""Zero-shot classification with an NLI classifier, as transformers' zero-shot-classification pipeline
does it (ZeroShotClassificationPipeline): each input is a premise, each candidate label put into a
hypothesis template is a hypothesis, and the model's entailment logits of the pairs become the labels'
scores. Pure functions; Engine.classify tokenizes the pairs and runs them through the scheduler.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import numpy as np

from embedserv.errors import InvalidInput

DEFAULT_HYPOTHESIS_TEMPLATE = "This example is {}."
# The replacement fields a template may hold: the label, by position. transformers calls str.format on
# the template, so "{0}" and escaped braces ("{{", "}}") work there too; attribute or index lookups and
# format specs ("{:>999999999}") do not belong in a string a server formats for its callers.
_LABEL_FIELDS = ("", "0")


def entailment_id(model_labels: Sequence[str]) -> int | None:
    """The first label whose name starts with "entail" in any case (the pipeline's rule); None if none."""
    for index, label in enumerate(model_labels):
        if label.lower().startswith("entail"):
            return index
    return None


def contradiction_id(entailment: int, num_labels: int) -> int:
    """What the pipeline contrasts entailment with in multi-label scoring: the first label, or the last
    when entailment is the first (it does not look for a label named contradiction)."""
    return num_labels - 1 if entailment == 0 else 0


def require_entailment(model_labels: Sequence[str], model_name: str) -> int:
    entailment = entailment_id(model_labels)
    if entailment is None:
        labels = ", ".join(model_labels) or "none"
        raise InvalidInput(
            f"candidate_labels needs an NLI model with an entailment label; model {model_name!r} has labels: "
            f"{labels}; leave candidate_labels empty to classify with the model's own labels"
        )
    return entailment


def check_options(candidate_labels: Sequence[str], hypothesis_template: str, multi_label: bool) -> None:
    """The zero-shot fields hang together: the template and multi_label need candidate labels, which must
    be non-empty and distinct (the response keys scores by label)."""
    if not candidate_labels:
        if hypothesis_template:
            raise InvalidInput("hypothesis_template needs candidate_labels; send the labels to score")
        if multi_label:
            raise InvalidInput("multi_label needs candidate_labels; send the labels to score")
        return
    seen: dict[str, int] = {}
    for index, label in enumerate(candidate_labels):
        if not label:
            raise InvalidInput(f"candidate_labels[{index}] is empty; every label needs a name")
        if label in seen:
            raise InvalidInput(
                f"candidate_labels[{index}] {label!r} repeats candidate_labels[{seen[label]}]; send each label once"
            )
        seen[label] = index


def hypotheses(candidate_labels: Sequence[str], hypothesis_template: str = "") -> list[str]:
    """Each label put into the template (empty: the pipeline's default), with str.format as the pipeline does."""
    template = hypothesis_template or DEFAULT_HYPOTHESIS_TEMPLATE
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise InvalidInput(
            f"hypothesis_template {template!r} is not a format string ({err}); write {{}} where the label goes "
            "and {{ or }} for a literal brace"
        ) from None
    if not fields:
        raise InvalidInput(
            f"hypothesis_template {template!r} has no {{}} where the label goes; e.g. {DEFAULT_HYPOTHESIS_TEMPLATE!r}"
        )
    for name, spec, conversion in fields:
        if name not in _LABEL_FIELDS or spec or conversion:
            raise InvalidInput(
                f"hypothesis_template {template!r} may only hold {{}} (or {{0}}) where the label goes, not "
                "field names, lookups or format specs; write {{ or }} for a literal brace"
            )
    try:
        return [template.format(label) for label in candidate_labels]
    except ValueError as err:  # "{0}" and "{}" mixed
        raise InvalidInput(f"hypothesis_template {template!r} cannot be formatted ({err}); use {{}} only") from None


def label_scores(
    logits: np.ndarray, num_inputs: int, entailment: int, multi_label: bool, raw_scores: bool
) -> np.ndarray:
    """[num_inputs * num_candidates, num_model_labels] logits, input-major -> [num_inputs, num_candidates].

    raw_scores: the entailment logits. multi_label (or one candidate label): per pair, the softmax of its
    [contradiction, entailment] logits, entailment's share. Otherwise the softmax of the entailment logits
    across one input's candidate labels."""
    logits = np.asarray(logits, dtype=np.float32)
    rows, num_model_labels = logits.shape
    if num_inputs < 1 or rows % num_inputs:
        raise ValueError(f"{rows} rows of logits do not split into {num_inputs} inputs")
    per_input = logits.reshape(num_inputs, rows // num_inputs, num_model_labels)
    entail = per_input[..., entailment]
    if raw_scores:
        return np.ascontiguousarray(entail)
    if multi_label or per_input.shape[1] == 1:
        contra = per_input[..., contradiction_id(entailment, num_model_labels)]
        # exp(e) / (exp(c) + exp(e)) without overflow: the logistic function of e - c.
        return (0.5 * (np.tanh(0.5 * (entail - contra)) + 1.0)).astype(np.float32)
    shifted = np.exp(entail - entail.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
