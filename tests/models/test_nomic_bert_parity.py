"""NomicBERT (nomic_bert) equals sentence-transformers / transformers on the same random weights: CLS and mean
pooling, nomic-embed's search_query / search_document prompts and Matryoshka dimensions, the classifier
head, every CPU attention backend, int8, and the published config.json + tensor-name form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.models import load_reference, reference_token_counts
from tests.helpers.rotary_encoder_models import (
    build_rotary_classifier,
    build_rotary_encoder,
    publish_nomic,
    write_native_names,
)
from tests.helpers.scorers import classifier_reference

MIN_COSINE = 0.9999
PROMPTS = {"search_query": "search_query: ", "search_document": "search_document: "}


def _embed(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(truncate=True, **kwargs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nomic")
    mean = build_rotary_encoder(root, "nomic_bert", "mean", prompts=PROMPTS)
    return {
        "mean": mean,
        "cls": build_rotary_encoder(root, "nomic_bert", "cls", seed=1),
        "mean-native-names": write_native_names(mean, root / "mean-native-names"),
        "mean-published": publish_nomic(mean, root / "mean-published"),
    }


@pytest.fixture(scope="module")
def expected(models, texts):
    """sentence-transformers' embeddings of the texts, per model."""
    return {name: load_reference(models[name]).encode(texts, convert_to_numpy=True) for name in ("mean", "cls")}


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_matches_sentence_transformers(pooling, models, expected, engine_for, texts):
    st = load_reference(models[pooling])
    counts = reference_token_counts(st, texts)
    assert max(counts) == 128, "the texts must run past max_seq_length"

    result = engine_for(models[pooling]).embed(texts, _embed())

    assert_cosine_at_least(result.embeddings, expected[pooling], MIN_COSINE, texts, what=f"nomic/{pooling}: ")
    assert_unit_norm(result.embeddings)
    assert result.prompt_tokens == sum(counts)


def test_prompt_name_and_dimensions_match_sentence_transformers(models, engine_for, texts):
    st = load_reference(models["mean"])
    engine = engine_for(models["mean"])

    for name in PROMPTS:
        want = st.encode(texts, prompt_name=name, convert_to_numpy=True)
        got = engine.embed(texts, _embed(prompt_name=name)).embeddings
        assert_cosine_at_least(got, want, MIN_COSINE, texts, what=f"prompt {name}: ")
        # Matryoshka: sentence-transformers' truncate_dim, then normalized.
        short = st.encode(texts, prompt_name=name, convert_to_numpy=True, truncate_dim=16)
        short = short / np.linalg.norm(short, axis=1, keepdims=True)
        got_short = engine.embed(texts, _embed(prompt_name=name, dimensions=16)).embeddings
        assert got_short.shape == (len(texts), 16)
        assert_cosine_at_least(got_short, short, MIN_COSINE, texts, what=f"prompt {name}, 16 dims: ")
    plain = engine.embed(texts, _embed()).embeddings
    assert not np.allclose(plain, got, atol=1e-3), "the prompt must change the embeddings"


@pytest.mark.parametrize("form", ["mean-native-names", "mean-published"])
def test_other_forms_of_the_same_weights_give_the_same_embeddings(form, models, expected, engine_for, texts):
    result = engine_for(models[form]).embed(texts, _embed())

    assert_cosine_at_least(result.embeddings, expected["mean"], MIN_COSINE, texts, what=f"{form}: ")


def test_published_config_reads_as_the_native_one(models):
    from embedserv.models.loading.hf_config import read_hf_config

    published = read_hf_config(models["mean-published"])
    native = read_hf_config(models["mean"])

    assert published.model_type == "nomic_bert"
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "type_vocab_size",
        "layer_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "head_dim",
    ):
        assert getattr(published, key) == getattr(native, key), key
    assert published.rope_parameters["rope_theta"] == native.rope_parameters["rope_theta"] == 1000.0


@pytest.mark.parametrize(
    ("key", "value"), [("prenorm", True), ("rotary_emb_interleaved", True), ("qkv_proj_bias", True)]
)
def test_published_config_refuses_what_it_cannot_map(key, value, models, tmp_path):
    from embedserv.errors import ConfigError
    from embedserv.models.loading.hf_config import read_hf_config

    out = publish_nomic(models["mean"], tmp_path / "changed")
    config = json.loads((out / "config.json").read_text())
    config[key] = value
    (out / "config.json").write_text(json.dumps(config))

    with pytest.raises(ConfigError, match=key):
        read_hf_config(out)


def test_classifier_matches_transformers(tmp_path_factory, engine_for, texts):
    from embedserv.types import ClassifyParams

    model_dir = build_rotary_classifier(tmp_path_factory.mktemp("nomic-ce"), "nomic_bert")
    logits = classifier_reference(model_dir, texts)

    raw = engine_for(model_dir).classify(texts, ClassifyParams(truncate=True, raw_scores=True))
    scores = engine_for(model_dir).classify(texts, ClassifyParams(truncate=True))

    np.testing.assert_allclose(raw.scores, logits, atol=1e-4)
    softmax = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(scores.scores, softmax / softmax.sum(axis=1, keepdims=True), atol=1e-4)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"


def test_naive_attention(models, expected, engine_for, texts):
    result = engine_for(models["cls"], attention_backend="naive").embed(texts, _embed())
    assert_cosine_at_least(result.embeddings, expected["cls"], MIN_COSINE, texts)


@pytest.mark.slow
def test_flex_attention(models, expected, engine_for, texts):
    result = engine_for(models["mean"], attention_backend="flex").embed(texts, _embed())
    assert_cosine_at_least(result.embeddings, expected["mean"], MIN_COSINE, texts)


def test_int8_stays_close_to_float32(models, engine_for, texts):
    full = engine_for(models["mean"]).embed(texts, _embed()).embeddings
    int8 = engine_for(models["mean"], quantization="int8").embed(texts, _embed()).embeddings
    assert_cosine_at_least(int8, full, 0.99, texts)
