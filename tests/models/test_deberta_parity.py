"""DeBERTa-v2/v3 equals the references on the same random weights (float32): embeddings equal
sentence-transformers (mean and CLS pooling, cosine >= 0.9999), cross-encoder scores and classifier
logits equal DebertaV2ForSequenceClassification (1e-4), zero-shot scores equal transformers'
zero-shot-classification pipeline, on the `texts` fixture (some past the 128-token limit and every bucket
range). The "v3", "v2" and "absolute" variants are described in tests/helpers/deberta_models.py. Also: the naive and
flex backends, int8 (cosine >= 0.99 to float32), varlen refused at start-up naming the backends that run
it, and what we do not serve refused at start-up.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, cosines
from tests.helpers.deberta_models import build_deberta_cross_encoder, build_deberta_embedder, build_deberta_nli
from tests.helpers.nli_models import zero_shot_reference
from tests.helpers.scorers import classifier_reference

ATOL = 1e-4
LABELS = ["animals", "finance", "weather", "cooking"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("deberta")


@pytest.fixture(scope="module")
def built(root):
    """Builds each model once per module, on first use: (kind, variant, option) -> directory."""
    models: dict[tuple, object] = {}

    def get(kind: str, variant: str, option):
        key = (kind, variant, option)
        if key not in models:
            if kind == "embed":
                models[key] = build_deberta_embedder(root, variant, option)
            elif kind == "cross":
                models[key] = build_deberta_cross_encoder(root, variant, num_labels=option)
            else:
                models[key] = build_deberta_nli(root, variant)
        return models[key]

    return get


def _st_embeddings(model_dir, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_numpy=True, batch_size=8)


def _embed(engine, texts):
    from embedserv.types import EmbedParams

    return engine.embed(texts, EmbedParams(truncate=True)).embeddings


@pytest.mark.parametrize("variant,pooling", [("v3", "mean"), ("v2", "cls"), ("absolute", "mean")])
def test_embeddings_equal_sentence_transformers(built, engine_for, texts, variant, pooling):
    model_dir = built("embed", variant, pooling)
    expected = _st_embeddings(model_dir, texts)
    actual = _embed(engine_for(model_dir), texts)
    assert_cosine_at_least(actual, expected, 0.9999)
    assert cosines(expected[:1].repeat(len(texts) - 1, 0), expected[1:]).min() < 0.999, "texts must differ"


def test_both_load_the_bundled_wordpiece_tokenizer(built, engine_for):
    """No SentencePiece files: transformers loads the class tokenizer_config.json names for deberta-v2 too,
    and our engine counts the same tokens."""
    from transformers import AutoTokenizer

    from embedserv.types import EmbedParams

    model_dir = built("embed", "v3", "mean")
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    assert type(reference).__name__.startswith("Bert")
    samples = ["Disentangled attention, tokenized alike.", "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich"]
    result = engine_for(model_dir).embed(samples, EmbedParams())
    assert result.prompt_tokens == sum(len(reference(sample)["input_ids"]) for sample in samples)


def _rerank_scores(engine, query, documents):
    from embedserv.types import RerankParams

    result = engine.rerank(query, documents, RerankParams(truncate=True))
    scores = np.full(len(documents), np.nan, dtype=np.float32)
    for ranked in result.results:
        scores[ranked.index] = ranked.score
    return scores


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_reranker_equals_transformers(built, engine_for, texts, variant):
    model_dir = built("cross", variant, 1)
    query = "how do I read a file line by line"
    logits = classifier_reference(model_dir, None, [(query, document) for document in texts])[:, 0]
    scores = _rerank_scores(engine_for(model_dir), query, texts)
    np.testing.assert_allclose(scores, 1.0 / (1.0 + np.exp(-logits)), atol=ATOL)
    assert np.ptp(scores) > 0.05


def test_classifier_equals_transformers(built, engine_for, texts):
    from embedserv.types import ClassifyParams

    model_dir = built("cross", "v3", 3)
    logits = classifier_reference(model_dir, texts)
    engine = engine_for(model_dir)
    raw = engine.classify(texts, ClassifyParams(truncate=True, raw_scores=True))
    result = engine.classify(texts, ClassifyParams(truncate=True))
    assert result.labels == ("negative", "neutral", "positive")
    np.testing.assert_allclose(raw.scores, logits, atol=ATOL)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.scores, e / e.sum(axis=1, keepdims=True), atol=ATOL)
    assert len(set(np.argmax(logits, axis=1))) > 1


@pytest.mark.parametrize("multi_label", [False, True], ids=["single-label", "multi-label"])
def test_zero_shot_equals_the_transformers_pipeline(built, engine_for, texts, multi_label):
    from embedserv.types import ClassifyParams

    model_dir = built("nli", "v3", None)
    premises = texts[:6]
    reference = zero_shot_reference(model_dir, premises, LABELS, multi_label=multi_label)
    expected = np.array([[row[label] for label in LABELS] for row in reference])
    result = engine_for(model_dir).classify(
        premises, ClassifyParams(candidate_labels=tuple(LABELS), multi_label=multi_label, truncate=True)
    )
    assert result.labels == tuple(LABELS)
    np.testing.assert_allclose(result.scores, expected, atol=ATOL)
    assert np.ptp(result.scores) > 0.05


@pytest.mark.parametrize("backend", ["naive", pytest.param("flex", marks=pytest.mark.slow)])
def test_other_cpu_backends_equal_sentence_transformers(built, engine_for, texts, backend):
    model_dir = built("embed", "v3", "mean")
    expected = _st_embeddings(model_dir, texts)
    assert_cosine_at_least(_embed(engine_for(model_dir, attention_backend=backend), texts), expected, 0.9999)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["naive", "flex"])
def test_other_cpu_backends_rerank(built, engine_for, texts, backend):
    model_dir = built("cross", "v2", 1)
    query = "how do I read a file line by line"
    logits = classifier_reference(model_dir, None, [(query, document) for document in texts])[:, 0]
    scores = _rerank_scores(engine_for(model_dir, attention_backend=backend), query, texts)
    np.testing.assert_allclose(scores, 1.0 / (1.0 + np.exp(-logits)), atol=ATOL)


def test_int8_stays_close_to_float32(built, engine_for, texts):
    model_dir = built("embed", "v3", "mean")
    full = _embed(engine_for(model_dir), texts)
    assert_cosine_at_least(_embed(engine_for(model_dir, quantization="int8"), texts), full, 0.99)


def test_varlen_is_refused_at_start_up_naming_the_backends_that_run_it(built):
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine
    from embedserv.errors import ConfigError

    config = ModelConfig(path=str(built("embed", "v3", "mean")), served_name="m", attention_backend="varlen")
    with pytest.raises(ConfigError, match="disentangled.*use sdpa, flex or naive"):
        SyncEngine(config)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"conv_kernel_size": 3}, "conv_kernel_size"),
        ({"pos_att_type": "p2c|c2p|p2p"}, "pos_att_type p2p"),
        ({"attention_head_size": 8}, "attention_head_size"),
    ],
)
def test_unserved_configs_are_refused_at_start_up(built, root, change, reason):
    import shutil

    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine
    from embedserv.errors import ConfigError

    source = built("cross", "v3", 1)
    model_dir = root / f"refused-{reason.split()[0]}"
    shutil.copytree(source, model_dir, dirs_exist_ok=True)
    config_path = model_dir / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | change))
    with pytest.raises(ConfigError, match=reason):
        SyncEngine(ModelConfig(path=str(model_dir), served_name="m"))
