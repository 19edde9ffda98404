"""EuroBERT equals the reference libraries on the same weights (float32).

Tiny random-weight models (tests/helpers/modernbert_models.py): two Llama-style layers attending both ways,
grouped KV heads, RoPE theta 250000, texts up to 128 tokens. Embeddings (CLS and mean pooling) equal
sentence-transformers on sdpa, naive and (slow) flex, and stay close under int8;
EuroBertForSequenceClassification ("bos", "mean" and "late" pooling) equals transformers within 1e-4, and
an unknown pooling is refused at start-up; the published custom-code config.json (auto_map, rope_theta, clf_pooling)
reads as the native config and gives the native outputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models.loading.hf_config import read_hf_config
from tests.helpers import modernbert_models
from tests.helpers.compare import assert_cosine_at_least, cosines
from tests.helpers.models import reference_token_counts
from tests.helpers.scorers import classifier_reference

MAX_SEQ_LENGTH = 128
MIN_COSINE = 0.9999
ATOL = 1e-4


def _embed():
    from embedserv.types import EmbedParams

    return EmbedParams(truncate=True)


def _classify(**kwargs):
    from embedserv.types import ClassifyParams

    return ClassifyParams(truncate=True, **kwargs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(kind, *args) -> model dir, built once in the module."""
    root = tmp_path_factory.mktemp("eurobert")
    builders = {
        "embedder": modernbert_models.build_eurobert_embedder,
        "classifier": modernbert_models.build_eurobert_classifier,
    }
    built: dict[tuple, object] = {}

    def get(kind: str, *args, **kwargs):
        key = (kind, args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = builders[kind](root, *args, **kwargs)
        return built[key]

    return get


@pytest.mark.parametrize("backend", ["sdpa", "naive", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_match_sentence_transformers(pooling, backend, models, reference, engine_for, texts):
    model_dir = models("embedder", pooling)
    st = reference(model_dir)
    counts = reference_token_counts(st, texts)
    assert max(counts) == MAX_SEQ_LENGTH

    # A small batch budget keeps flex's warm-up to two compiled size classes.
    engine = engine_for(model_dir, attention_backend=backend, max_batch_tokens=256)
    result = engine.embed(texts, _embed())

    assert engine.info.is_causal is False and engine.info.attention_backend == backend
    expected = st.encode(texts, convert_to_numpy=True)
    assert_cosine_at_least(result.embeddings, expected, MIN_COSINE, texts, what=f"{pooling}/{backend}: ")
    assert result.prompt_tokens == sum(counts)
    assert np.all(cosines(expected[:-1], expected[1:]) < 0.999), "random outputs of different texts must differ"


def test_int8_stays_close_to_float32(models, engine_for, texts):
    model_dir = models("embedder", "mean")
    full = engine_for(model_dir).embed(texts, _embed()).embeddings

    int8 = engine_for(model_dir, quantization="int8").embed(texts, _embed()).embeddings

    assert_cosine_at_least(int8, full, 0.99, texts, what="int8 vs float32: ")
    assert not np.allclose(int8, full, atol=1e-6), "int8 must change the linears"


@pytest.mark.parametrize("pooling", ["bos", "mean", "late"])
def test_classifier_equals_transformers(pooling, models, engine_for, texts):
    model_dir = models("classifier", pooling, seed=1)
    logits = classifier_reference(model_dir, texts)
    engine = engine_for(model_dir)

    result = engine.classify(texts, _classify())
    raw = engine.classify(texts, _classify(raw_scores=True))

    assert result.labels == ("negative", "neutral", "positive")
    np.testing.assert_allclose(raw.scores, logits, atol=ATOL)
    np.testing.assert_allclose(result.scores, _softmax(logits), atol=ATOL)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"


def test_an_unknown_classifier_pooling_is_refused_at_start_up(models, tmp_path):
    import json
    import shutil

    from embedserv.models.loading.spec_reader import read_model_spec

    model_dir = tmp_path / "max-pooling"
    shutil.copytree(models("classifier", "late"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "classifier_pooling": "max"}))
    with pytest.raises(ConfigError, match="classifier_pooling 'max' is not supported"):
        read_model_spec(ModelConfig(path=str(model_dir), served_name="m"))


def test_published_config_reads_as_the_native_one(models, engine_for, texts, tmp_path):
    native_dir = models("embedder", "mean")
    published = modernbert_models.eurobert_published_form(native_dir, tmp_path / "embedder")
    config = read_hf_config(published)
    assert config.model_type == "eurobert" and config.num_key_value_heads == 2
    assert config.rope_parameters["rope_theta"] == modernbert_models.EUROBERT_THETA

    got = engine_for(published).embed(texts, _embed()).embeddings

    np.testing.assert_allclose(got, engine_for(native_dir).embed(texts, _embed()).embeddings, atol=1e-6)


def test_published_classifier_keeps_its_clf_pooling(models, engine_for, texts, tmp_path):
    """`clf_pooling: "bos"` is the classifier's pooling (transformers alone would read the default, "late"),
    and its output layer is `out_proj`."""
    from safetensors import safe_open

    native_dir = models("classifier", "bos", seed=1)
    published = modernbert_models.eurobert_published_form(native_dir, tmp_path / "classifier")
    assert read_hf_config(published).classifier_pooling == "bos"
    with safe_open(str(published / "model.safetensors"), "pt") as weights:
        assert {"out_proj.weight", "out_proj.bias"} <= set(weights.keys())

    raw = engine_for(published).classify(texts, _classify(raw_scores=True))

    np.testing.assert_allclose(raw.scores, classifier_reference(native_dir, texts), atol=ATOL)
