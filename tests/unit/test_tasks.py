"""What a model can do and how its scores are finished, read from its files (no model runs here)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from embedserv.engine.tasks.outputs import activate, rank
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.loading.tasks import QWEN3_RERANKER, read_task_spec, rerank_activation
from embedserv.types import Task


def _config(architecture: str, **fields) -> SimpleNamespace:
    return SimpleNamespace(architectures=[architecture], **fields)


def _family(config: SimpleNamespace):
    """The family a test config's architecture belongs to (Qwen3 ones: Llama's; the rest: BERT's)."""
    return registry.lookup("qwen3" if config.architectures[0].startswith("Qwen3") else "bert")


def _labels(*names: str) -> dict[int, str]:
    return dict(enumerate(names))


def test_embedder_embeds_and_reranks_by_cosine(tmp_path):
    spec = read_task_spec(
        tmp_path, _config("BertModel"), _family(_config("BertModel")), is_causal=False, decoder_reranker=None
    )
    assert spec.tasks == (Task.EMBED, Task.RERANK) and spec.rerank_mode == "embeddings"


def test_one_label_classifier_is_a_cross_encoder(tmp_path):
    config = _config("BertForSequenceClassification", id2label=_labels("LABEL_0"))
    spec = read_task_spec(tmp_path, config, _family(config), is_causal=False, decoder_reranker=None)
    assert spec.tasks == (Task.RERANK, Task.CLASSIFY)
    assert (spec.rerank_mode, spec.rerank_activation, spec.strip_trailing_pad_id) == ("pair", "sigmoid", None)


def test_many_label_classifier_only_classifies(tmp_path):
    config = _config(
        "XLMRobertaForSequenceClassification",
        id2label={2: "c", 0: "a", 1: "b"},
        problem_type="multi_label_classification",
    )
    spec = read_task_spec(tmp_path, config, _family(config), is_causal=False, decoder_reranker=None)
    assert spec.tasks == (Task.CLASSIFY,) and spec.rerank_mode is None
    assert spec.labels == ("a", "b", "c") and spec.multi_label


def test_token_classifier_only_classifies_tokens_and_other_token_heads_are_refused(tmp_path):
    config = _config("XLMRobertaForTokenClassification", id2label={1: "B-PER", 0: "O"})
    spec = read_task_spec(tmp_path, config, _family(config), is_causal=False, decoder_reranker=None)
    assert spec.tasks == (Task.TOKEN_CLASSIFY,) and spec.labels == ("O", "B-PER") and spec.rerank_mode is None
    # Qwen3ForTokenClassification exists in transformers; the llama family has no token head: refused, not
    # served as an embedder of its backbone.
    unserved = _config("Qwen3ForTokenClassification", id2label=_labels("O", "B-PER"))
    with pytest.raises(ConfigError, match="Qwen3ForTokenClassification is not served .*heads of llama: none"):
        read_task_spec(tmp_path, unserved, _family(unserved), is_causal=True, decoder_reranker=None)


def test_decoder_classifier_strips_trailing_padding_only_when_causal(tmp_path):
    config = _config("Qwen3ForSequenceClassification", id2label=_labels("x"), pad_token_id=7)
    assert (
        read_task_spec(tmp_path, config, _family(config), is_causal=True, decoder_reranker=None).strip_trailing_pad_id
        == 7
    )
    assert (
        read_task_spec(tmp_path, config, _family(config), is_causal=False, decoder_reranker=None).strip_trailing_pad_id
        is None
    )


@pytest.mark.parametrize(
    ("directory", "flag", "expected"),
    [
        ("models--Qwen--Qwen3-Reranker-0.6B/snapshots/abc", None, True),
        ("qwen3-0.6b", None, False),
        ("qwen3-0.6b", True, True),
        ("my-reranker", False, False),
    ],
)
def test_causal_lm_is_a_yes_no_reranker_by_path_or_flag(tmp_path, directory, flag, expected):
    spec = read_task_spec(
        tmp_path / directory,
        _config("Qwen3ForCausalLM"),
        _family(_config("Qwen3ForCausalLM")),
        is_causal=True,
        decoder_reranker=flag,
    )
    assert (spec.template is QWEN3_RERANKER) is expected
    assert spec.tasks == ((Task.RERANK,) if expected else (Task.EMBED, Task.RERANK))


def test_the_flag_leaves_other_models_alone(tmp_path):
    spec = read_task_spec(
        tmp_path / "reranker",
        _config("BertModel"),
        _family(_config("BertModel")),
        is_causal=False,
        decoder_reranker=True,
    )
    assert spec.template is None and Task.EMBED in spec.tasks


def _write_st_config(directory: Path, activation: str) -> None:
    (directory / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": activation}))


def test_activation_read_where_cross_encoder_reads_it(tmp_path):
    bare = SimpleNamespace()
    assert rerank_activation(tmp_path, bare, num_labels=1) == "sigmoid"
    assert rerank_activation(tmp_path, bare, num_labels=3) == "identity"
    legacy = SimpleNamespace(sbert_ce_default_activation_function="torch.nn.modules.activation.Tanh")
    assert rerank_activation(tmp_path, legacy, 1) == "tanh"
    v4 = SimpleNamespace(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert rerank_activation(tmp_path, v4, 1) == "identity"
    _write_st_config(tmp_path, "torch.nn.modules.activation.Tanh")
    assert rerank_activation(tmp_path, v4, 1) == "tanh"


def test_untrusted_activation_falls_back_and_unknown_torch_activation_refuses(tmp_path):
    _write_st_config(tmp_path, "my_package.Scaled")
    assert rerank_activation(tmp_path, SimpleNamespace(), 1) == "sigmoid"
    _write_st_config(tmp_path, "torch.nn.modules.activation.Softsign")
    with pytest.raises(ConfigError, match="Softsign is not supported"):
        rerank_activation(tmp_path, SimpleNamespace(), 1)


def test_activations_match_their_definitions():
    logits = np.array([[-800.0, 0.0, 2.0], [1.0, 1.0, 1.0]], dtype=np.float32)
    with np.errstate(over="ignore"):  # the float64 reference overflows to inf (sigmoid 0); ours must not warn
        expected = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(activate(logits, "sigmoid"), expected, atol=1e-7)
    np.testing.assert_allclose(activate(logits, "softmax").sum(axis=1), [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(activate(logits, "softmax")[1], [1 / 3] * 3, atol=1e-7)
    np.testing.assert_allclose(activate(logits, "tanh"), np.tanh(logits))
    assert activate(logits, "identity") is logits


def test_rank_is_best_first_stable_and_cut_at_top_n():
    scores = np.array([0.1, 0.9, 0.5, 0.9], dtype=np.float32)
    assert [i for i, _ in rank(scores, None)] == [1, 3, 2, 0]
    assert [i for i, _ in rank(scores, 2)] == [1, 3]
    assert len(rank(scores, 10)) == 4
