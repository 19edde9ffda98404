"""--lora adapters (models/lora.py, models/loading/lora_files.py) equal PEFT's merged model (float32): embedders
against sentence-transformers over merge_and_unload() (BERT, XLM-R, MPNet and ModernBERT; every target,
partial q/k/v, rsLoRA, different ranks), a BERT cross-encoder's scores against transformers' merged
classifier, int8 within its tolerance; one step mixing the base and three adapters equals each run alone.

Each adapter moves the outputs far from the base's (checked), so an adapter left out, applied to the wrong
rows or with the wrong scaling fails the parity.
"""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.types import EmbedParams, RerankParams
from tests.helpers.classic_models import ATOL, INT8_MIN_COSINE, MIN_COSINE, build_classic_encoder
from tests.helpers.compare import assert_cosine_at_least, cosines
from tests.helpers.lora_models import (
    BERT_TARGETS,
    MODERNBERT_TARGETS,
    MPNET_TARGETS,
    build_adapter,
    merged_model,
    merged_sentence_transformer,
)
from tests.helpers.models import build_tiny_encoder
from tests.helpers.modernbert_models import build_modernbert_embedder
from tests.helpers.scorers import build_cross_encoder, classifier_reference

MAX_SEQ_LENGTH = 128
# (name, seed, LoraConfig fields): every target; q and v only (k's block of the packed qkv stays zero);
# rsLoRA at another rank; one layer's key and MLP input only.
BERT_ADAPTERS = (
    ("all", 1, dict(r=8, lora_alpha=16, target_modules=list(BERT_TARGETS))),
    ("qv", 2, dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["query", "value"])),
    ("layer1", 3, dict(r=16, lora_alpha=8, target_modules=["key", "intermediate.dense"], layers_to_transform=[1])),
)


def _adapters(root, model_dir, specs, kind="embed"):
    return {name: build_adapter(model_dir, root / f"adapter-{name}", seed, kind, **lora) for name, seed, lora in specs}


def _embed(engine, name: str | None, texts: list[str]) -> np.ndarray:
    """The texts' embeddings from the base (name None) or one of its adapters, as a request naming it gets."""
    served = engine.engine if name is None else engine.engine.for_adapter(name)
    return engine._call(served.embedding.embed(texts, EmbedParams(truncate=True))).embeddings


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bert")
    model_dir = build_tiny_encoder(root, "bert", "mean", max_seq_length=MAX_SEQ_LENGTH)
    return root, model_dir, _adapters(root, model_dir, BERT_ADAPTERS)


def _lora(adapters: dict) -> tuple:
    return tuple((name, str(path)) for name, path in adapters.items())


def test_bert_adapters_equal_peft_merged_sentence_transformers(bert, engine_for, reference, texts):
    root, model_dir, adapters = bert
    engine = engine_for(model_dir, lora=_lora(adapters))
    assert engine.info.lora_adapters == tuple(adapters)
    base = _embed(engine, None, texts)
    assert_cosine_at_least(base, reference(model_dir).encode(texts), MIN_COSINE, texts, what="base: ")
    for name, adapter_dir in adapters.items():
        st = reference(merged_sentence_transformer(model_dir, adapter_dir, root / f"merged-{name}", "mean", 128))
        got = _embed(engine, name, texts)
        assert_cosine_at_least(got, st.encode(texts), MIN_COSINE, texts, what=f"adapter {name}: ")
        assert cosines(got, base).max() < 0.99, f"adapter {name} must move the outputs to mean something"


@pytest.mark.parametrize("family", ["mpnet", "modernbert", "xlm-roberta"])
def test_other_families_adapters_equal_peft_merged(family, tmp_path, engine_for, reference, texts):
    builders = {
        "mpnet": (
            lambda: build_classic_encoder(tmp_path, "mpnet", "mean", max_seq_length=MAX_SEQ_LENGTH),
            MPNET_TARGETS,
        ),
        "modernbert": (
            lambda: build_modernbert_embedder(tmp_path, "mean", max_seq_length=MAX_SEQ_LENGTH),
            MODERNBERT_TARGETS,
        ),
        "xlm-roberta": (
            lambda: build_tiny_encoder(tmp_path, "xlm-roberta", "mean", max_seq_length=MAX_SEQ_LENGTH),
            BERT_TARGETS,
        ),
    }
    build, targets = builders[family]
    model_dir = build()
    adapters = _adapters(tmp_path, model_dir, (("all", 4, dict(r=8, lora_alpha=32, target_modules=list(targets))),))
    engine = engine_for(model_dir, lora=_lora(adapters))
    st = reference(merged_sentence_transformer(model_dir, adapters["all"], tmp_path / "merged", "mean", 128))
    got = _embed(engine, "all", texts)
    assert_cosine_at_least(got, st.encode(texts), MIN_COSINE, texts, what=f"{family} adapter: ")
    assert cosines(got, _embed(engine, None, texts)).max() < 0.99


def test_cross_encoder_adapter_scores_equal_peft_merged_transformers(tmp_path, engine_for, texts):
    model_dir = build_cross_encoder(tmp_path, "bert", max_seq_length=MAX_SEQ_LENGTH)
    specs = (("ce", 5, dict(r=8, lora_alpha=16, target_modules=list(BERT_TARGETS))),)
    adapter_dir = _adapters(tmp_path, model_dir, specs, kind="classify")["ce"]
    engine = engine_for(model_dir, lora=(("ce", str(adapter_dir)),))
    query, documents = texts[0], texts[1:13]
    merged = merged_model(model_dir, adapter_dir, tmp_path / "merged", kind="classify")
    expected = classifier_reference(merged, None, [(query, d) for d in documents])[:, 0]
    served = engine.engine.for_adapter("ce")
    result = engine._call(served.reranking.rerank(query, documents, RerankParams(truncate=True, raw_scores=True)))
    got = np.array([r.score for r in sorted(result.results, key=lambda r: r.index)])
    np.testing.assert_allclose(got, expected, atol=ATOL)
    base = engine.rerank(query, documents, RerankParams(truncate=True, raw_scores=True))
    assert np.abs(got - np.array([r.score for r in sorted(base.results, key=lambda r: r.index)])).max() > 0.05


def test_seq_cls_adapters_score_with_their_own_heads(tmp_path, texts):
    """task_type SEQ_CLS saves the classifier per adapter (modules_to_save): each adapter's scores equal its
    merged model's, in one step with the base and an adapter without a head of its own."""
    from embedserv.config import ModelConfig
    from embedserv.engine.served_model import read_served_model
    from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
    from embedserv.worker.replica import build_runner

    model_dir = build_cross_encoder(tmp_path, "bert", num_labels=3, max_seq_length=MAX_SEQ_LENGTH)
    specs = (
        ("head", 6, dict(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")),
        ("plain", 7, dict(r=4, lora_alpha=8, target_modules=["key", "intermediate.dense"])),
    )
    adapters = _adapters(tmp_path, model_dir, specs, kind="classify")
    config = ModelConfig(path=str(model_dir), served_name="m", dtype="float32", lora=_lora(adapters), warm_up=False)
    served = read_served_model(config)
    runner = build_runner(config, served.spec)
    encoded = served.tokenizer.encode_batch(texts[:6], truncate=True)
    chosen = [0, -1, 1, 0, 1, -1]
    step = StepBatch(
        tuple(
            ScheduledSequence(
                request_id=i,
                token_ids=tuple(e.ids),
                output=OutputKind.SCORE,
                adapter=adapter,
                token_type_ids=tuple(e.token_type_ids) if e.token_type_ids is not None else None,
            )
            for i, (e, adapter) in enumerate(zip(encoded, chosen, strict=True))
        )
    )
    got = runner.execute(step)
    references = {-1: classifier_reference(model_dir, texts[:6])} | {
        index: classifier_reference(merged_model(model_dir, path, tmp_path / f"merged-{name}", "classify"), texts[:6])
        for index, (name, path) in enumerate(adapters.items())
    }
    for i, adapter in enumerate(chosen):
        np.testing.assert_allclose(got.rows[got.row_request_ids.index(i)], references[adapter][i], atol=ATOL)
    from safetensors.torch import load_file

    saved = load_file(str(adapters["head"] / "adapter_model.safetensors"))
    base_head = load_file(str(model_dir / "model.safetensors"))["classifier.weight"]
    assert (saved["base_model.model.classifier.weight"] - base_head).abs().max() > 0.05, "the head must differ"
    assert np.abs(references[0] - references[-1]).max() > 0.05


def test_int8_adds_adapters_to_the_int8_linears(bert, engine_for, reference, texts):
    root, model_dir, adapters = bert
    engine = engine_for(model_dir, lora=_lora(adapters), quantization="int8")
    st = reference(merged_sentence_transformer(model_dir, adapters["all"], root / "merged-all", "mean", 128))
    assert_cosine_at_least(_embed(engine, "all", texts), st.encode(texts), INT8_MIN_COSINE, texts, what="int8: ")


def test_one_step_mixing_adapters_equals_each_alone(bert, texts):
    """Sequences of the base and three adapters in one StepBatch, in an order that interleaves them, give
    each sequence the rows it gets alone (the runner's own step, so the mix is certain)."""
    from embedserv.config import ModelConfig
    from embedserv.engine.served_model import read_served_model
    from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
    from embedserv.worker.replica import build_runner

    _, model_dir, adapters = bert
    config = ModelConfig(path=str(model_dir), served_name="m", dtype="float32", lora=_lora(adapters), warm_up=False)
    served = read_served_model(config)
    runner = build_runner(config, served.spec)
    ids = [served.tokenizer.encode_batch([t], truncate=True)[0].ids for t in texts[:8]]
    chosen = [-1, 0, 1, 2, 0, -1, 2, 1]
    sequences = tuple(
        ScheduledSequence(request_id=i, token_ids=tuple(tokens), output=OutputKind.POOL, adapter=adapter)
        for i, (tokens, adapter) in enumerate(zip(ids, chosen, strict=True))
    )
    mixed = runner.execute(StepBatch(sequences))
    for i, sequence in enumerate(sequences):
        alone = runner.execute(StepBatch((sequence,)))
        row = mixed.rows[mixed.row_request_ids.index(i)]
        np.testing.assert_allclose(row, alone.rows[0], atol=1e-5, err_msg=f"sequence {i}, adapter {chosen[i]}")
    rows = mixed.rows[[mixed.row_request_ids.index(i) for i in (0, 1, 2, 3)]]
    assert cosines(rows[1:], np.repeat(rows[:1], 3, axis=0)).max() < 0.99, "the adapters must differ from the base"
