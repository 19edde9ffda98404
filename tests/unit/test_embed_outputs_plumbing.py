"""The plumbing of per-sequence outputs (dense, sparse, token vectors) from the step to the call, and the
module arrangements a model directory may have: what the worker computes for whom, what crosses the
process boundary, and what the engine refuses before it tokenizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embedserv.engine.tasks import embedding
from embedserv.engine.tasks.embedding import top_k
from embedserv.errors import ConfigError, InvalidInput
from embedserv.executor.messages import CODEC, StepDone
from embedserv.models.loading.st_files import read_sentence_transformers
from embedserv.steps import OutputKind, RaggedRows, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import EmbedOutput, EmbedParams, ModelInfo, Task
from embedserv.worker.input_builder import InputBuilder

DENSE, SPARSE, MULTI = EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR


def _seq(request_id: int, ids: tuple[int, ...], outputs=()) -> ScheduledSequence:
    return ScheduledSequence(request_id=request_id, token_ids=ids, output=OutputKind.POOL, outputs=outputs)


def test_each_sequence_gets_only_the_outputs_it_asked_for():
    builder = InputBuilder(torch.device("cpu"), 0, False)
    batch = StepBatch(
        (
            _seq(10, (1, 2, 3)),
            _seq(11, (4, 5, 6, 7, 8), (SPARSE, MULTI)),
            _seq(12, (9, 10), (MULTI,)),
            _seq(13, (11, 12, 13, 14), (DENSE, SPARSE)),
        )
    )
    inputs = builder.build(batch)
    ids = inputs.tokens.input_ids.tolist()
    assert inputs.rows.request_ids == (10, 13)
    sparse, vectors = inputs.sparse_tokens, inputs.vector_tokens
    assert sparse.request_ids == (11, 13) and list(sparse.lengths) == [5, 4]
    assert [ids[r] for r in sparse.rows.tolist()] == [4, 5, 6, 7, 8, 11, 12, 13, 14]
    assert sparse.input_ids.tolist() == [4, 5, 6, 7, 8, 11, 12, 13, 14]
    assert sparse.seq.tolist() == [0] * 5 + [1] * 4
    assert vectors.request_ids == (11, 12)
    assert [ids[r] for r in vectors.rows.tolist()] == [4, 5, 6, 7, 8, 9, 10]
    assert vectors.seq.tolist() == [0] * 5 + [1] * 2


def test_a_dense_only_batch_builds_no_token_plans():
    inputs = InputBuilder(torch.device("cpu"), 0, False).build(StepBatch((_seq(1, (1, 2)), _seq(2, (3,), (DENSE,)))))
    assert inputs.rows.request_ids == (1, 2) and inputs.sparse_tokens is None and inputs.vector_tokens is None


def test_ragged_outputs_cross_the_worker_boundary_bit_exact():
    rng = np.random.default_rng(0)
    vectors = RaggedRows(
        (5, 7), np.array([3, 2]), rng.standard_normal((5, 4)).astype(np.float32), np.zeros(0, np.int64)
    )
    sparse = RaggedRows((5,), np.array([3]), np.array([0.5, 1.5, 2.5], np.float32), np.array([3, 17, 900]))
    done = StepDone(4, StepOutput((), np.zeros((0, 0), np.float32), (), np.zeros(0, np.int64), sparse, vectors), 0.1)
    back = CODEC.decode(CODEC.encode(done))
    assert back.output.vectors.request_ids == (5, 7)
    np.testing.assert_array_equal(back.output.vectors.values, vectors.values)
    split = back.output.sparse.split()
    np.testing.assert_array_equal(split[5][0], [0.5, 1.5, 2.5])
    np.testing.assert_array_equal(split[5][1], [3, 17, 900])
    assert [v.shape for v, _ in back.output.vectors.split().values()] == [(3, 4), (2, 4)]


def test_ragged_rows_refuse_counts_that_do_not_add_up():
    with pytest.raises(ValueError, match="entries"):
        RaggedRows((1, 2), np.array([2, 2]), np.zeros((3, 4), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="indices"):
        RaggedRows((1,), np.array([2]), np.zeros(2, np.float32), np.zeros(1, np.int64))


def test_top_k_keeps_the_largest_values_with_ascending_indices():
    kept = top_k(np.array([0.1, 0.9, 0.5, 0.9], np.float32), np.array([2, 5, 8, 11]), 2)
    assert kept.indices.tolist() == [5, 11] and kept.values.tolist() == pytest.approx([0.9, 0.9])
    assert top_k(np.array([0.3], np.float32), np.array([4]), None).indices.tolist() == [4]


def _info(outputs, tasks) -> ModelInfo:
    return ModelInfo(
        name="m",
        tasks=tasks,
        architecture="BertModel",
        is_causal=False,
        pooling="mean",
        dimension=8,
        max_input_tokens=16,
        prompt_names=(),
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
        outputs=outputs,
    )


@pytest.mark.parametrize(
    "params, message",
    [
        (EmbedParams(outputs=(SPARSE,)), "cannot serve EmbedSparse; it serves: embed, embed_multi_vector"),
        (EmbedParams(outputs=(DENSE, SPARSE)), "cannot give the sparse output; its outputs: dense, multi_vector"),
        (EmbedParams(outputs=(DENSE, DENSE)), "names an output twice"),
        (EmbedParams(outputs=()), "outputs is empty"),
        (EmbedParams(sparse_top_k=3), "top_k applies to the sparse output"),
        (EmbedParams(outputs=(MULTI,), dimensions=4), "dimensions applies to the dense output"),
    ],
)
def test_outputs_a_model_cannot_give_are_refused_naming_its_outputs(params, message):
    info = _info((DENSE, MULTI), (Task.EMBED, Task.EMBED_MULTI_VECTOR, Task.RERANK))
    with pytest.raises(InvalidInput, match=message):
        embedding.check_outputs(info, params)


def test_sparse_top_k_zero_is_refused():
    info = _info((SPARSE,), (Task.EMBED_SPARSE,))
    with pytest.raises(InvalidInput, match="top_k must be at least 1"):
        embedding.check_outputs(info, EmbedParams(outputs=(SPARSE,), sparse_top_k=0))


def _st_dir(root: Path, modules: list[tuple[str, str]], model_type: str | None = None, configs=None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for idx, (kind, path) in enumerate(modules):
        package = {
            "Transformer": "base.modules.transformer",
            "Pooling": "sentence_transformer.modules.pooling",
            "Dense": "base.modules.dense",
            "Normalize": "base.modules.normalize",
            "SpladePooling": "sparse_encoder.modules.splade_pooling",
            "MultiVectorMask": "multi_vector_encoder.modules.multi_vector_mask",
        }[kind]
        entries.append({"idx": idx, "name": str(idx), "path": path, "type": f"sentence_transformers.{package}.{kind}"})
        if path:
            (root / path).mkdir(exist_ok=True)
            (root / path / "config.json").write_text(json.dumps((configs or {}).get(kind, {})))
    (root / "modules.json").write_text(json.dumps(entries))
    if model_type is not None:
        (root / "config_sentence_transformers.json").write_text(json.dumps({"model_type": model_type}))
    return root


_DENSE_CONFIG = {"in_features": 8, "out_features": 4, "bias": False}


@pytest.mark.parametrize(
    "modules, model_type",
    [
        # Token-level Dense and Normalize without Pooling, in a directory that says SentenceTransformer (or
        # nothing): a MultiVectorEncoder layout served as one vector would be wrong without a word.
        ([("Transformer", ""), ("Dense", "1_Dense"), ("Normalize", "2_Normalize")], None),
        ([("Transformer", ""), ("Dense", "1_Dense"), ("Normalize", "2_Normalize")], "SentenceTransformer"),
        ([("Transformer", ""), ("Normalize", "1_Normalize"), ("Pooling", "2_Pooling")], None),
        ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Pooling", "2_Pooling")], None),
        ([("Transformer", ""), ("Pooling", "1_Pooling"), ("MultiVectorMask", "2_Mask")], None),
        ([("Transformer", ""), ("Pooling", "1_Pooling")], "MultiVectorEncoder"),
    ],
)
def test_module_arrangements_it_does_not_understand_stop_start_up(tmp_path, modules, model_type):
    configs = {"Pooling": {"pooling_mode": "mean"}, "Dense": _DENSE_CONFIG}
    model_dir = _st_dir(tmp_path / "m", modules, model_type, configs)
    with pytest.raises(ConfigError, match="not an arrangement embedserv serves"):
        read_sentence_transformers(model_dir)


def test_unknown_model_type_and_fill_mask_mismatch_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="model_type 'Router' is not served"):
        read_sentence_transformers(_st_dir(tmp_path / "a", [("Transformer", "")], "Router"))
    sparse = _st_dir(tmp_path / "b", [("Transformer", ""), ("SpladePooling", "1_SpladePooling")], "SparseEncoder")
    with pytest.raises(ConfigError, match="SparseEncoder directories need the fill-mask task"):
        read_sentence_transformers(sparse)
    (sparse / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "fill-mask"}))
    assert read_sentence_transformers(sparse).splade.pooling == "max"


def test_a_multi_vector_encoder_keeps_its_token_modules_apart_from_pooled_ones(tmp_path):
    model_dir = _st_dir(
        tmp_path / "mve",
        [("Transformer", ""), ("Dense", "1_Dense"), ("Normalize", "2_Normalize"), ("MultiVectorMask", "3_Mask")],
        "MultiVectorEncoder",
        {"Dense": _DENSE_CONFIG, "MultiVectorMask": {"skiplist_words": ["!"]}},
    )
    st = read_sentence_transformers(model_dir)
    assert st.dense == () and st.pooling is None
    assert st.multi_vector.normalize and st.multi_vector.dense[0].out_features == 4
    assert st.multi_vector.mask == {"skiplist_words": ["!"]}
