"""MPNet (models/families/mpnet.py) equals the references on small random-weight models (float32):
embeddings equal sentence-transformers (CLS and mean pooling, every CPU attention backend), a cross-encoder
and a classifier equal MPNetForSequenceClassification, and int8 stays close to float32.

MPNet's relative position bias is T5's bucketing (attention/relative_bias.py) added after 1/sqrt(d)
scaling; the tiny models' bias table is scaled up (tests/helpers/classic_models.py) so a wrong bucket,
scale or order shows in the outputs.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.attention.relative_bias import relative_position_bucket
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
    root = tmp_path_factory.mktemp("mpnet")
    cache: dict[tuple, object] = {}

    def get(kind: str, *args, **kwargs):
        key = (kind, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            builder = {"embed": build_classic_encoder, "cross": build_classic_cross_encoder}[kind]
            cache[key] = builder(root, "mpnet", *args, max_seq_length=MAX_SEQ_LENGTH, **kwargs)
        return cache[key]

    return get


def test_the_bucketing_is_transformers_mpnet_bucketing():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    distance = torch.arange(-700, 701)  # key - query, past max_distance both ways
    ours = relative_position_bucket(distance, bidirectional=True, num_buckets=32, max_distance=128)
    assert torch.equal(ours, MPNetEncoder.relative_position_bucket(distance))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_embeddings_equal_sentence_transformers(pooling, models, reference, engine_for, texts):
    model_dir = models("embed", pooling)
    check_embeddings(engine_for(model_dir), reference(model_dir), texts, MAX_SEQ_LENGTH, what=f"mpnet/{pooling}: ")


def test_naive_backend_equals_sentence_transformers(models, reference, engine_for, texts):
    model_dir = models("embed", "mean")
    engine = engine_for(model_dir, attention_backend="naive")
    check_embeddings(engine, reference(model_dir), texts, MAX_SEQ_LENGTH, what="mpnet/naive: ")


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_flex_backend_equals_sentence_transformers(pooling, models, reference, engine_for, texts):
    model_dir = models("embed", pooling)
    engine = engine_for(model_dir, attention_backend="flex")
    check_embeddings(engine, reference(model_dir), texts, MAX_SEQ_LENGTH, what=f"mpnet/flex/{pooling}: ")


def test_the_models_depend_on_the_relative_bias(models, reference, texts):
    """Without its bias table the reference moves well past the parity tolerance, so the parity above
    checks the bias too."""
    from tests.helpers.compare import cosines

    st = reference(models("embed", "mean"))
    expected = st.encode(texts[:8], convert_to_numpy=True)
    table = st[0].auto_model.encoder.relative_attention_bias.weight
    saved = table.detach().clone()
    try:
        with torch.no_grad():
            table.zero_()
        unbiased = st.encode(texts[:8], convert_to_numpy=True)
    finally:
        with torch.no_grad():
            table.copy_(saved)
    assert cosines(unbiased, expected).max() < 0.999


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
    assert_cosine_at_least(int8, full, INT8_MIN_COSINE, texts, what="mpnet int8: ")


def test_varlen_is_refused_at_start_up_naming_the_backends_that_run_it(models):
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine
    from embedserv.errors import ConfigError

    config = ModelConfig(path=str(models("embed", "mean")), served_name="m", attention_backend="varlen")
    with pytest.raises(ConfigError, match="the relative position bias of T5 and MPNet; use sdpa, flex or naive"):
        SyncEngine(config)
