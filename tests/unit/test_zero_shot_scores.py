"""engine/tasks/zero_shot.py's pure functions against the arithmetic of transformers' zero-shot pipeline
(ZeroShotClassificationPipeline.entailment_id and .postprocess), written out here as it is there."""

from __future__ import annotations

import re

import numpy as np
import pytest

from embedserv.engine.tasks import zero_shot
from embedserv.errors import InvalidInput


def pipeline_scores(logits: np.ndarray, num_inputs: int, entailment_id: int, multi_label: bool) -> np.ndarray:
    """postprocess() of transformers 5, for every input at once."""
    reshaped = logits.reshape((num_inputs, logits.shape[0] // num_inputs, -1))
    if multi_label or reshaped.shape[1] == 1:
        contradiction_id = -1 if entailment_id == 0 else 0
        entail_contr = reshaped[..., [contradiction_id, entailment_id]]
        return (np.exp(entail_contr) / np.exp(entail_contr).sum(-1, keepdims=True))[..., 1]
    entail = reshaped[..., entailment_id]
    return np.exp(entail) / np.exp(entail).sum(-1, keepdims=True)


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        (("contradiction", "neutral", "entailment"), 2),
        (("ENTAILMENT", "NEUTRAL", "CONTRADICTION"), 0),
        (("entailment", "not_entailment"), 0),
        (("Entails", "neutral", "entailment"), 0),  # the first that starts with "entail"
        (("negative", "positive"), None),
        (("not_entailment", "other"), None),
        ((), None),
    ],
)
def test_entailment_id_is_the_first_label_starting_with_entail(labels, expected):
    assert zero_shot.entailment_id(labels) == expected


@pytest.mark.parametrize("entailment", [0, 1, 2])
@pytest.mark.parametrize("multi_label", [False, True])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_scores_equal_the_pipelines_arithmetic(entailment, multi_label, num_labels):
    rng = np.random.default_rng(entailment * 10 + num_labels)
    num_inputs = 4
    logits = rng.normal(scale=3.0, size=(num_inputs * num_labels, 3)).astype(np.float32)

    scores = zero_shot.label_scores(logits, num_inputs, entailment, multi_label, raw_scores=False)

    assert scores.shape == (num_inputs, num_labels) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, pipeline_scores(logits, num_inputs, entailment, multi_label), atol=1e-6)


def test_raw_scores_are_the_entailment_logits_and_large_logits_do_not_overflow():
    logits = np.array([[0.0, 1.0, 900.0], [5.0, 1.0, -900.0]], dtype=np.float32)

    assert zero_shot.label_scores(logits, 1, 2, False, raw_scores=True).tolist() == [[900.0, -900.0]]
    np.testing.assert_allclose(zero_shot.label_scores(logits, 1, 2, False, False), [[1.0, 0.0]])
    np.testing.assert_allclose(zero_shot.label_scores(logits, 1, 2, True, False), [[1.0, 0.0]])


def test_contradiction_is_the_first_label_or_the_last_when_entailment_is_first():
    assert zero_shot.contradiction_id(2, 3) == 0
    assert zero_shot.contradiction_id(1, 2) == 0
    assert zero_shot.contradiction_id(0, 3) == 2
    assert zero_shot.contradiction_id(0, 2) == 1


def test_hypotheses_format_the_label_as_the_pipeline_does():
    assert zero_shot.hypotheses(["sports", "a {b}"]) == ["This example is sports.", "This example is a {b}."]
    assert zero_shot.hypotheses(["x"], "{0} or {0} {{literal}}") == ["x or x {literal}"]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("no slot", "has no {} where the label goes"),
        ("{{}}", "has no {} where the label goes"),
        ("{label}", "may only hold {} (or {0})"),
        ("{0.__class__}", "may only hold {} (or {0})"),
        ("{:>1000000000}", "may only hold {} (or {0})"),
        ("{!r}", "may only hold {} (or {0})"),
        ("{1}", "may only hold {} (or {0})"),
        ("{", "is not a format string"),
        ("{0} and {}", "cannot be formatted"),
    ],
)
def test_bad_templates_are_refused(template, message):
    with pytest.raises(InvalidInput, match=f"hypothesis_template .*{re.escape(message)}"):
        zero_shot.hypotheses(["x"], template)


def test_options_need_candidate_labels_and_labels_must_be_distinct_and_named():
    zero_shot.check_options((), "", False)
    zero_shot.check_options(("a", "b"), "It is {}.", True)
    with pytest.raises(InvalidInput, match="hypothesis_template needs candidate_labels"):
        zero_shot.check_options((), "It is {}.", False)
    with pytest.raises(InvalidInput, match="multi_label needs candidate_labels"):
        zero_shot.check_options((), "", True)
    with pytest.raises(InvalidInput, match=r"candidate_labels\[0\] is empty"):
        zero_shot.check_options(("",), "", False)
    with pytest.raises(InvalidInput, match=r"candidate_labels\[1\] 'a' repeats candidate_labels\[0\]"):
        zero_shot.check_options(("a", "a"), "", False)
    with pytest.raises(InvalidInput, match="model 'm' has labels: negative, positive"):
        zero_shot.require_entailment(("negative", "positive"), "m")
