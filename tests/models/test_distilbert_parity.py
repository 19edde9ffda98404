"""DistilBERT (models/families/distilbert.py) equals the references on small random-weight models (float32):
embeddings equal sentence-transformers (CLS and mean pooling; a Dense 64 -> 32 Tanh module after the
pooling, as distiluse-base-multilingual-cased has; sinusoidal position tables; every CPU attention
backend), a cross-encoder and a classifier equal DistilBertForSequenceClassification (pre_classifier + ReLU),
and int8 stays close to float32.
"""

from __future__ import annotations

import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.classic_models import (
    INT8_MIN_COSINE,
    build_classic_cross_encoder,
    build_classic_encoder,
    check_classify,
    check_embeddings,
    check_rerank,
)
from tests.helpers.compare import assert_cosine_at_least

MAX_SEQ_LENGTH = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distilbert")
    cache: dict[tuple, object] = {}

    def get(kind: str, *args, **kwargs):
        key = (kind, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            builder = {"embed": build_classic_encoder, "cross": build_classic_cross_encoder}[kind]
            cache[key] = builder(root, "distilbert", *args, max_seq_length=MAX_SEQ_LENGTH, **kwargs)
        return cache[key]

    return get


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_equal_sentence_transformers(pooling, models, reference, engine_for, texts):
    model_dir = models("embed", pooling)
    check_embeddings(engine_for(model_dir), reference(model_dir), texts, MAX_SEQ_LENGTH, what=f"distilbert/{pooling}: ")


def test_a_dense_module_after_pooling_as_distiluse_has(models, reference, engine_for, texts):
    model_dir = models("embed", "mean", dense=(32, "tanh"))
    engine = engine_for(model_dir)
    assert engine.info.dimension == 32
    check_embeddings(engine, reference(model_dir), texts, MAX_SEQ_LENGTH, what="distilbert/dense: ")


def test_sinusoidal_position_tables_and_relu(models, reference, engine_for, texts):
    """`sinusoidal_pos_embds` checkpoints (the table saved like a learned one) and activation relu."""
    model_dir = models("embed", "cls", sinusoidal_pos_embds=True, activation="relu")
    check_embeddings(engine_for(model_dir), reference(model_dir), texts, MAX_SEQ_LENGTH, what="distilbert/sin: ")


def test_naive_backend_equals_sentence_transformers(models, reference, engine_for, texts):
    model_dir = models("embed", "mean")
    engine = engine_for(model_dir, attention_backend="naive")
    check_embeddings(engine, reference(model_dir), texts, MAX_SEQ_LENGTH, what="distilbert/naive: ")


@pytest.mark.slow
def test_flex_backend_equals_sentence_transformers(models, reference, engine_for, texts):
    model_dir = models("embed", "cls")
    engine = engine_for(model_dir, attention_backend="flex")
    check_embeddings(engine, reference(model_dir), texts, MAX_SEQ_LENGTH, what="distilbert/flex: ")


def test_cross_encoder_equals_sentence_transformers_and_transformers(models, engine_for):
    documents = stdlib_texts(12, seed=7)
    query = " ".join(stdlib_texts(1, seed=11)[0].split()[:8])
    model_dir = models("cross")
    check_rerank(engine_for(model_dir), model_dir, query, documents, MAX_SEQ_LENGTH)


def test_classifier_equals_transformers(models, engine_for, texts):
    model_dir = models("cross", num_labels=3, seed=1)
    check_classify(engine_for(model_dir), model_dir, texts)


def test_int8_stays_close_to_float32(models, engine_for, texts):
    from embedserv.types import EmbedParams

    model_dir = models("embed", "mean")
    params = EmbedParams(truncate=True)
    full = engine_for(model_dir).embed(texts, params).embeddings
    int8 = engine_for(model_dir, quantization="int8").embed(texts, params).embeddings
    assert_cosine_at_least(int8, full, INT8_MIN_COSINE, texts, what="distilbert int8: ")
