"""Classify equals transformers on the same weights: softmax for single-label models, sigmoid per label for
multi-label ones, logits with raw_scores, label names from id2label (float32, absolute error <= 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.scorers import build_cross_encoder, build_decoder_classifier, classifier_reference

ATOL = 1e-4


def _params(**kwargs):
    from embedserv.types import ClassifyParams

    return ClassifyParams(**kwargs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "xlmr3": build_cross_encoder(root, "xlm-roberta", num_labels=3),
        "bert-multi": build_cross_encoder(root, "bert", num_labels=3, multi_label=True, seed=2),
        "qwen3-4": build_decoder_classifier(root, "qwen3", num_labels=4, seed=1),
    }


def test_xlmr_classifier_equals_transformers_softmax(models, engine_for, texts):
    model_dir = models["xlmr3"]
    logits = classifier_reference(model_dir, texts)
    engine = engine_for(model_dir)

    result = engine.classify(texts, _params(truncate=True))
    raw = engine.classify(texts, _params(truncate=True, raw_scores=True))

    assert result.labels == ("negative", "neutral", "positive")
    assert engine.info.labels == result.labels and engine.info.dimension == 0
    assert [t.value for t in engine.info.tasks] == ["classify"]
    np.testing.assert_allclose(result.scores, _softmax(logits), atol=ATOL)
    np.testing.assert_allclose(raw.scores, logits, atol=ATOL)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"


def test_multi_label_classifier_uses_sigmoid(models, engine_for, texts):
    model_dir = models["bert-multi"]
    logits = classifier_reference(model_dir, texts)

    result = engine_for(model_dir).classify(texts, _params(truncate=True))

    np.testing.assert_allclose(result.scores, 1.0 / (1.0 + np.exp(-logits)), atol=ATOL)
    assert not np.allclose(result.scores.sum(axis=1), 1.0, atol=1e-2)


def test_decoder_classifier_equals_transformers(models, engine_for, texts):
    model_dir = models["qwen3-4"]
    logits = classifier_reference(model_dir, texts)

    result = engine_for(model_dir).classify(texts, _params(truncate=True))

    assert result.labels == ("LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3")
    np.testing.assert_allclose(result.scores, _softmax(logits), atol=ATOL)


def test_classify_refuses_long_inputs_unless_truncate(models, engine_for, texts):
    from embedserv.errors import InvalidInput

    with pytest.raises(InvalidInput, match="more than the model's limit of 128"):
        engine_for(models["xlmr3"]).classify(texts, _params())


def test_each_model_refuses_the_tasks_it_cannot_do(models, bundled_dir, engine_for):
    from embedserv.errors import InvalidInput
    from embedserv.types import EmbedParams

    classifier = engine_for(models["xlmr3"])
    embedder = engine_for(bundled_dir)
    with pytest.raises(InvalidInput, match="cannot serve Rerank; it serves: classify"):
        classifier.rerank("query", ["document"])
    with pytest.raises(InvalidInput, match="cannot serve Embed; it serves: classify"):
        classifier.embed(["text"], EmbedParams())
    with pytest.raises(InvalidInput, match="cannot serve Classify; it serves: embed, embed_multi_vector, rerank"):
        embedder.classify(["text"])
