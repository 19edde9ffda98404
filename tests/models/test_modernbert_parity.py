"""ModernBERT equals the reference libraries on the same weights (float32), over inputs far longer than
its local window.

Tiny random-weight models (tests/helpers/modernbert_models.py): four layers alternating global and local
attention (a window of 16: each token sees 8 on each side) with their own rotary thetas, texts up to 128
tokens. Embeddings (CLS and mean pooling) equal sentence-transformers on sdpa, naive and (slow) flex, and
stay close under int8; ModernBertForSequenceClassification (classifier_pooling cls and mean, with and
without biases) equals transformers within 1e-4, as a classifier and as a reranker; the published form
(transformers 4.48's config.json keys, ModernBertForMaskedLM tensor names) loads as the native one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedserv.models.families.modernbert import ModernBertModel, layer_sliding_window
from embedserv.models.loading.hf_config import read_hf_config
from tests.helpers import modernbert_models
from tests.helpers.compare import assert_cosine_at_least, cosines
from tests.helpers.models import reference_token_counts
from tests.helpers.scorers import classifier_reference

MAX_SEQ_LENGTH = 128
MIN_COSINE = 0.9999
ATOL = 1e-4


def _embed(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(truncate=True, **kwargs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(kind, *args) -> model dir, built once in the module."""
    root = tmp_path_factory.mktemp("modernbert")
    builders = {
        "embedder": modernbert_models.build_modernbert_embedder,
        "classifier": modernbert_models.build_modernbert_classifier,
    }
    built: dict[tuple, object] = {}

    def get(kind: str, *args, **kwargs):
        key = (kind, args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = builders[kind](root, *args, **kwargs)
        return built[key]

    return get


def test_local_layers_attend_within_half_their_window_each_side():
    """local_attention 128 (the published models'): transformers keeps |p - j| <= 64, ours |p - j| < 65;
    every third layer is global, and each kind rotates with its own theta."""
    from transformers import ModernBertConfig

    config = ModernBertConfig(num_hidden_layers=6, global_attn_every_n_layers=3, local_attention=128)
    assert [layer_sliding_window(config, i) for i in range(6)] == [None, 65, 65, None, 65, 65]
    with torch.device("meta"):
        model = ModernBertModel(config)
    thetas = {kind: rotary.params["rope_theta"] for kind, rotary in model.rotary.items()}
    assert thetas == {"full_attention": 160_000.0, "sliding_attention": 10_000.0}


@pytest.mark.parametrize("backend", ["sdpa", "naive", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_match_sentence_transformers(pooling, backend, models, reference, engine_for, texts):
    model_dir = models("embedder", pooling)
    st = reference(model_dir)
    counts = reference_token_counts(st, texts)
    assert max(counts) == MAX_SEQ_LENGTH > 4 * modernbert_models.LOCAL_ATTENTION, "inputs must outgrow the window"

    # A small batch budget keeps flex's warm-up to two compiled size classes.
    engine = engine_for(model_dir, attention_backend=backend, max_batch_tokens=256)
    result = engine.embed(texts, _embed())

    assert engine.info.pooling == pooling and engine.info.attention_backend == backend
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


# (classifier_pooling, seed, biases): seeds whose random logits give the texts more than one label.
CLASSIFIERS = [("cls", 1, False), ("mean", 2, True)]


@pytest.mark.parametrize(("pooling", "seed", "biases"), CLASSIFIERS)
def test_classifier_equals_transformers(pooling, seed, biases, models, engine_for, texts):
    from embedserv.types import ClassifyParams

    model_dir = models("classifier", pooling, seed=seed, biases=biases)
    logits = classifier_reference(model_dir, texts)
    engine = engine_for(model_dir)

    result = engine.classify(texts, ClassifyParams(truncate=True))
    raw = engine.classify(texts, ClassifyParams(truncate=True, raw_scores=True))

    assert result.labels == ("negative", "neutral", "positive")
    np.testing.assert_allclose(raw.scores, logits, atol=ATOL)
    np.testing.assert_allclose(result.scores, _softmax(logits), atol=ATOL)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"


def test_reranker_equals_cross_encoder(models, engine_for, texts):
    """gte-reranker-modernbert's shape: one label, mean pooling, sigmoid; long documents truncated."""
    from sentence_transformers import CrossEncoder

    from embedserv.types import RerankParams

    model_dir = models("classifier", "mean", num_labels=1)
    query, documents = " ".join(texts[0].split()[:8]), texts[1:25]
    reference = CrossEncoder(str(model_dir), device="cpu")
    assert max(len(reference.tokenizer(query, d)["input_ids"]) for d in documents) > MAX_SEQ_LENGTH
    expected = reference.predict([(query, d) for d in documents])

    result = engine_for(model_dir).rerank(query, documents, RerankParams(truncate=True))

    got = np.full(len(documents), np.nan, dtype=np.float32)
    for ranked in result.results:
        got[ranked.index] = ranked.score
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert expected.std() > 0.02, "scores must spread for the check to mean something"


def test_published_form_loads_as_the_native_one(models, reference, engine_for, texts, tmp_path):
    native_dir = models("embedder", "cls")
    published = modernbert_models.published_form(native_dir, tmp_path / "published")
    config = read_hf_config(published)
    assert config.layer_types == read_hf_config(native_dir).layer_types
    assert config.rope_parameters["full_attention"]["rope_theta"] == modernbert_models.GLOBAL_THETA
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == modernbert_models.LOCAL_THETA

    got = engine_for(published).embed(texts, _embed()).embeddings

    native = engine_for(native_dir).embed(texts, _embed()).embeddings
    np.testing.assert_allclose(got, native, atol=1e-6)
    assert_cosine_at_least(got, reference(published).encode(texts, convert_to_numpy=True), MIN_COSINE, texts)


@pytest.mark.parametrize("is_causal", [False, True])
def test_banded_local_attention_equals_naive(is_causal):
    """ModernBERT's real window (65) over runs long enough for the sdpa backend's banded path (blocks of
    queries over the keys they reach), two sequences of one length among others, grouped KV heads too."""
    from embedserv.attention.backends.naive import NaiveBackend
    from embedserv.attention.backends.sdpa import SdpaBackend
    from embedserv.attention.backends.sdpa_window import is_banded
    from embedserv.attention.layer import Attention
    from embedserv.attention.metadata import build_common_metadata
    from embedserv.forward_context import set_forward_context
    from embedserv.worker.layer_routes import forward_context_for

    lengths = [1100, 1100, 1030, 100, 3]
    assert is_banded(65, 1030) and not is_banded(65, 1000)
    torch.manual_seed(0)
    layers = [Attention(4, 16, num_kv_heads=kv, layer_index=i, sliding_window=65) for i, kv in enumerate((4, 2))]
    outputs = {}
    for backend in (SdpaBackend(), NaiveBackend()):
        metadata = backend.build_metadata(build_common_metadata(np.array(lengths), is_causal=is_causal))
        with torch.inference_mode(), set_forward_context(forward_context_for(layers, backend, metadata)):
            generator = torch.Generator().manual_seed(1)
            outputs[backend.name] = [
                layer(
                    *(
                        torch.randn(sum(lengths), 16 * n, generator=generator)
                        for n in (4, layer.num_kv_heads, layer.num_kv_heads)
                    )
                )
                for layer in layers
            ]
    for got, expected in zip(outputs["sdpa"], outputs["naive"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
