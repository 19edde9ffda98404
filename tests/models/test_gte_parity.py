"""Alibaba GTE (transformers' gte) equals sentence-transformers / transformers on the same random weights: CLS
and mean pooling, with and without token types, NTK-scaled RoPE, the classifier head (gte-multilingual-reranker),
every CPU attention backend, int8, and the published forms (model_type "new" with new-impl's keys and tensor
names; Snowflake's "gte" with the same keys)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.models import load_reference, reference_token_counts
from tests.helpers.rotary_encoder_models import (
    build_rotary_classifier,
    build_rotary_encoder,
    publish_gte,
    write_native_names,
)
from tests.helpers.scorers import classifier_reference

MIN_COSINE = 0.9999
NTK = {"type": "ntk", "factor": 2.0}


def _embed(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(truncate=True, **kwargs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gte")
    cls = build_rotary_encoder(root, "gte", "cls")
    return {
        "cls": cls,
        # gte-base-en-v1.5 has no token type embeddings.
        "mean-no-types": build_rotary_encoder(root, "gte", "mean", seed=1, type_vocab_size=0),
        "cls-native-names": write_native_names(cls, root / "cls-native-names"),
        "cls-new": publish_gte(cls, root / "cls-new"),
        "cls-snowflake": publish_gte(cls, root / "cls-snowflake", model_type="gte"),
        "cls-new-ntk": publish_gte(cls, root / "cls-new-ntk", rope_scaling=NTK),
    }


@pytest.fixture(scope="module")
def expected(models, texts):
    return {
        name: load_reference(models[name]).encode(texts, convert_to_numpy=True) for name in ("cls", "mean-no-types")
    }


@pytest.mark.parametrize("name", ["cls", "mean-no-types"])
def test_matches_sentence_transformers(name, models, expected, engine_for, texts):
    st = load_reference(models[name])
    counts = reference_token_counts(st, texts)
    assert max(counts) == 128, "the texts must run past max_seq_length"

    result = engine_for(models[name]).embed(texts, _embed())

    assert_cosine_at_least(result.embeddings, expected[name], MIN_COSINE, texts, what=f"gte/{name}: ")
    assert_unit_norm(result.embeddings)
    assert result.prompt_tokens == sum(counts)


@pytest.mark.parametrize("form", ["cls-native-names", "cls-new", "cls-snowflake"])
def test_other_forms_of_the_same_weights_give_the_same_embeddings(form, models, expected, engine_for, texts):
    result = engine_for(models[form]).embed(texts, _embed())

    assert_cosine_at_least(result.embeddings, expected["cls"], MIN_COSINE, texts, what=f"{form}: ")


def _ntk_reference(model_dir, texts, factor: float) -> np.ndarray:
    """transformers' GteModel with new-impl's NTK frequencies (transformers 5.23 has no ntk rope type), CLS
    pooled and normalized, one text at a time as sentence-transformers tokenizes it."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32).eval()
    dim = model.config.hidden_size // model.config.num_attention_heads
    base = model.config.rope_parameters["rope_theta"] * factor
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)) / factor ** (2 / dim)
    model.rotary_emb.inv_freq.copy_(inv_freq)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = []
    for text in texts:
        encoded = tokenizer(text, truncation=True, max_length=128, return_tensors="pt")
        with torch.no_grad():
            rows.append(model(**encoded).last_hidden_state[0, 0])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def test_ntk_rope_matches_the_published_scaling(models, expected, engine_for, texts):
    want = _ntk_reference(models["cls"], texts, NTK["factor"])

    got = engine_for(models["cls-new-ntk"]).embed(texts, _embed()).embeddings

    assert_cosine_at_least(got, want, MIN_COSINE, texts, what="ntk: ")
    assert not np.allclose(got, expected["cls"], atol=1e-3), "NTK scaling must change the embeddings"


def test_published_config_reads_as_the_native_one(models):
    from embedserv.models.loading.hf_config import read_hf_config

    native = read_hf_config(models["cls"])
    for form in ("cls-new", "cls-snowflake", "cls-new-ntk"):
        published = read_hf_config(models[form])
        assert published.model_type == "gte"
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
        ):
            assert getattr(published, key) == getattr(native, key), (form, key)
    ntk = read_hf_config(models["cls-new-ntk"]).rope_parameters
    assert (ntk["rope_type"], ntk["factor"], ntk["rope_theta"]) == ("ntk", 2.0, 500_000.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("logn_attention_scale", True),
        ("layer_norm_type", "rms_norm"),
        ("pack_qkv", False),
        ("rope_scaling", {"type": "yarn", "factor": 2.0}),
    ],
)
def test_published_config_refuses_what_it_cannot_map(key, value, models, tmp_path):
    from embedserv.errors import ConfigError
    from embedserv.models.loading.hf_config import read_hf_config

    out = publish_gte(models["cls"], tmp_path / "changed")
    config = json.loads((out / "config.json").read_text())
    config[key] = value
    (out / "config.json").write_text(json.dumps(config))

    with pytest.raises(ConfigError, match=key if key != "rope_scaling" else "yarn"):
        read_hf_config(out)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    root = tmp_path_factory.mktemp("gte-ce")
    model_dir = build_rotary_classifier(root, "gte")
    return {"native": model_dir, "new": publish_gte(model_dir, root / "ce-new")}


@pytest.mark.parametrize("form", ["native", "new"])
def test_classifier_matches_transformers(form, classifier, engine_for, texts):
    from embedserv.types import ClassifyParams

    logits = classifier_reference(classifier["native"], texts)
    engine = engine_for(classifier[form])

    raw = engine.classify(texts, ClassifyParams(truncate=True, raw_scores=True))
    scores = engine.classify(texts, ClassifyParams(truncate=True))

    np.testing.assert_allclose(raw.scores, logits, atol=1e-4)
    softmax = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(scores.scores, softmax / softmax.sum(axis=1, keepdims=True), atol=1e-4)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"


def test_naive_attention(models, expected, engine_for, texts):
    result = engine_for(models["mean-no-types"], attention_backend="naive").embed(texts, _embed())
    assert_cosine_at_least(result.embeddings, expected["mean-no-types"], MIN_COSINE, texts)


@pytest.mark.slow
def test_flex_attention(models, expected, engine_for, texts):
    result = engine_for(models["cls"], attention_backend="flex").embed(texts, _embed())
    assert_cosine_at_least(result.embeddings, expected["cls"], MIN_COSINE, texts)


def test_int8_stays_close_to_float32(models, engine_for, texts):
    full = engine_for(models["cls"]).embed(texts, _embed()).embeddings
    int8 = engine_for(models["cls"], quantization="int8").embed(texts, _embed()).embeddings
    assert_cosine_at_least(int8, full, 0.99, texts)
