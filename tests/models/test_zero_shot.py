"""Zero-shot Classify (candidate_labels) equals transformers' zero-shot-classification pipeline on the same
NLI weights: single-label (softmax of the entailment logits across the labels), multi-label (contradiction
vs entailment per label), one label, a custom hypothesis template, truncated premises, raw entailment
logits (float32, absolute error <= 1e-4). Bad zero-shot requests are refused naming the field.

NLI_MODELS lists the models compared; an entry is a builder of a model directory under a temporary root,
so another architecture (an encoder-decoder NLI model) is one more entry.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.nli_models import build_nli_classifier, zero_shot_reference

ATOL = 1e-4
TEXTS = [
    "The cat slept on the warm windowsill all afternoon.",
    "Stocks fell sharply after the central bank raised interest rates.",
    "Heavy rain and strong winds are expected along the coast tonight.",
    "She simmered the tomato sauce slowly and served it over fresh pasta.",
    "The striker scored twice in the final minutes of the match.",
]
LABELS = ["animals", "finance", "weather", "cooking"]

# name -> builder(root) of a model directory. Entailment last (MNLI order), and entailment first with
# upper-case names, which makes transformers contrast it with the last label in multi-label scoring.
NLI_MODELS = {
    "bert-mnli": lambda root: build_nli_classifier(root, "bert"),
    "roberta-entailment-first": lambda root: build_nli_classifier(
        root, "roberta", labels=("ENTAILMENT", "NEUTRAL", "CONTRADICTION"), seed=3
    ),
}


def _params(**kwargs):
    from embedserv.types import ClassifyParams

    return ClassifyParams(**kwargs)


@pytest.fixture(scope="module")
def nli_root(tmp_path_factory):
    return tmp_path_factory.mktemp("nli")


@pytest.fixture(scope="module")
def nli_dirs(nli_root):
    """Builds each model once per module, on first use."""
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = NLI_MODELS[name](nli_root)
        return built[name]

    return get


@pytest.fixture(params=sorted(NLI_MODELS))
def nli_dir(request, nli_dirs):
    return nli_dirs(request.param)


def _matrix(reference: list[dict[str, float]], labels: list[str]) -> np.ndarray:
    return np.array([[row[label] for label in labels] for row in reference], dtype=np.float64)


@pytest.mark.parametrize("multi_label", [False, True], ids=["single-label", "multi-label"])
def test_zero_shot_equals_the_transformers_pipeline(nli_dir, engine_for, multi_label):
    expected = _matrix(zero_shot_reference(nli_dir, TEXTS, LABELS, multi_label=multi_label), LABELS)

    result = engine_for(nli_dir).classify(TEXTS, _params(candidate_labels=tuple(LABELS), multi_label=multi_label))

    assert result.labels == tuple(LABELS)
    assert result.scores.shape == (len(TEXTS), len(LABELS)) and result.scores.dtype == np.float32
    np.testing.assert_allclose(result.scores, expected, atol=ATOL)
    if multi_label:
        assert not np.allclose(result.scores.sum(axis=1), 1.0, atol=1e-2)
    else:
        np.testing.assert_allclose(result.scores.sum(axis=1), 1.0, atol=1e-5)
    assert np.ptp(result.scores) > 0.05, "random weights must still tell the labels apart"


def test_custom_template_and_label_order(nli_dir, engine_for):
    template = "This text is about {}."
    labels = ["cooking", "weather", "finance"]
    expected = _matrix(zero_shot_reference(nli_dir, TEXTS, labels, hypothesis_template=template), labels)
    default = engine_for(nli_dir).classify(TEXTS, _params(candidate_labels=tuple(labels)))

    result = engine_for(nli_dir).classify(TEXTS, _params(candidate_labels=tuple(labels), hypothesis_template=template))

    assert result.labels == tuple(labels)
    np.testing.assert_allclose(result.scores, expected, atol=ATOL)
    assert not np.allclose(result.scores, default.scores, atol=1e-3), "the template must change the hypotheses"


def test_one_label_is_scored_against_contradiction(nli_dir, engine_for):
    # transformers scores a single candidate label as multi-label does, whatever multi_label says.
    expected = _matrix(zero_shot_reference(nli_dir, TEXTS, ["weather"]), ["weather"])

    result = engine_for(nli_dir).classify(TEXTS, _params(candidate_labels=("weather",)))

    np.testing.assert_allclose(result.scores, expected, atol=ATOL)
    assert not np.allclose(result.scores, 1.0)


def test_long_premises_are_cut_only_with_truncate(nli_dirs, engine_for, texts):
    # The module's 40 texts, some past the 128-token limit: the pipeline cuts the premise ("only_first").
    from embedserv.errors import InvalidInput

    model_dir = nli_dirs("bert-mnli")
    labels = ["code", "prose"]
    engine = engine_for(model_dir)
    with pytest.raises(InvalidInput, match=r"with the hypothesis of candidate_labels\[0\] has \d+ tokens"):
        engine.classify(texts, _params(candidate_labels=tuple(labels)))

    result = engine.classify(texts, _params(candidate_labels=tuple(labels), truncate=True, multi_label=True))

    expected = _matrix(zero_shot_reference(model_dir, texts, labels, multi_label=True), labels)
    np.testing.assert_allclose(result.scores, expected, atol=ATOL)


def test_raw_scores_are_the_entailment_logits(nli_dirs, engine_for):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = nli_dirs("bert-mnli")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pairs = [(text, f"This example is {label}.") for text in TEXTS[:2] for label in LABELS]
    with torch.no_grad():
        logits = model(
            **tokenizer([p for p, _ in pairs], [h for _, h in pairs], padding=True, return_tensors="pt")
        ).logits
    expected = logits[:, 2].numpy().reshape(2, len(LABELS))

    result = engine_for(model_dir).classify(TEXTS[:2], _params(candidate_labels=tuple(LABELS), raw_scores=True))

    np.testing.assert_allclose(result.scores, expected, atol=ATOL)
    assert result.prompt_tokens == sum(len(tokenizer(p, h)["input_ids"]) for p, h in pairs)


def test_ordinary_classify_is_unchanged_on_an_nli_model(nli_dirs, engine_for):
    result = engine_for(nli_dirs("bert-mnli")).classify(TEXTS[:2], _params())

    assert result.labels == ("contradiction", "neutral", "entailment")
    np.testing.assert_allclose(result.scores.sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(candidate_labels=("a", "")), r"candidate_labels\[1\] is empty"),
        (dict(candidate_labels=("a", "b", "a")), r"candidate_labels\[2\] 'a' repeats candidate_labels\[0\]"),
        (dict(candidate_labels=("a",), hypothesis_template="About this."), "hypothesis_template .* has no {}"),
        (dict(candidate_labels=("a",), hypothesis_template="About {label}."), "hypothesis_template .* may only hold"),
        (dict(candidate_labels=("a",), hypothesis_template="About {"), "hypothesis_template .* is not a format"),
        (dict(hypothesis_template="About {}."), "hypothesis_template needs candidate_labels"),
        (dict(multi_label=True), "multi_label needs candidate_labels"),
        (
            dict(candidate_labels=("a", "x " * 200)),
            r"hypothesis of candidate_labels\[1\] has \d+ tokens, which "
            "leaves no room",
        ),
    ],
)
def test_bad_zero_shot_requests_name_the_field(nli_dirs, engine_for, fields, message):
    from embedserv.errors import InvalidInput

    with pytest.raises(InvalidInput, match=message):
        engine_for(nli_dirs("bert-mnli")).classify(TEXTS[:1], _params(**fields))


def test_a_classifier_without_an_entailment_label_refuses_candidate_labels(nli_root, engine_for):
    from embedserv.errors import InvalidInput

    sentiment = build_nli_classifier(nli_root, "bert", labels=("negative", "neutral", "positive"), seed=1)

    with pytest.raises(InvalidInput, match="candidate_labels needs an NLI model .* negative, neutral, positive"):
        engine_for(sentiment).classify(TEXTS[:1], _params(candidate_labels=("a", "b")))
