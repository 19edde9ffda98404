"""--lora adapters the server cannot apply as PEFT would stop start-up with a message that names the
adapter and says why: DoRA, pickle weights, saved modules other than the classifier head, biases, ranks past the limit,
targets the model lacks or runs in a head, embedding LoRA, generating models and families not covered."""

from __future__ import annotations

import shutil

import pytest

from embedserv.config import ModelConfig, ServerConfig
from embedserv.errors import ConfigError
from embedserv.models.loading.spec_reader import read_model_spec
from tests.helpers.classic_models import build_classic_encoder
from tests.helpers.lora_models import BERT_TARGETS, MPNET_TARGETS, build_adapter, edit_adapter_config
from tests.helpers.models import build_tiny_encoder


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-refusals")
    return root, build_tiny_encoder(root, "bert", "mean")


def _adapter(root, model_dir, name: str, seed: int = 1, **lora):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": list(BERT_TARGETS)} | lora
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    return build_adapter(model_dir, out, seed, **lora)


def _config(model_dir, name: str, adapter_dir) -> ModelConfig:
    return ModelConfig(
        path=str(model_dir), served_name="m", dtype="float32", warm_up=False, lora=((name, str(adapter_dir)),)
    )


def _spec_refuses(model_dir, name, adapter_dir, *words: str) -> str:
    with pytest.raises(ConfigError) as refused:
        read_model_spec(_config(model_dir, name, adapter_dir))
    message = str(refused.value)
    assert name in message and all(word in message for word in words), message
    return message


def _load_refuses(model_dir, name, adapter_dir, *words: str) -> str:
    """Refusals that need the model's layers: the worker's attach, run here in process."""
    from embedserv.worker.replica import build_runner

    config = _config(model_dir, name, adapter_dir)
    with pytest.raises(ConfigError) as refused:
        build_runner(config, read_model_spec(config))
    message = str(refused.value)
    assert name in message and all(word in message for word in words), message
    return message


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"use_dora": True}, ("DoRA",)),
        ({"bias": "all"}, ("bias 'all'",)),
        ({"modules_to_save": ["classifier", "pooler"]}, ("modules_to_save: pooler", "classifier head")),
        ({"alpha_pattern": {"query": 4}}, ("alpha_pattern",)),
        ({"r": 128}, ("rank 128", "64")),
        ({"rank_pattern": {"value": 96}}, ("rank 96",)),
        ({"peft_type": "IA3"}, ("IA3",)),
    ],
    ids=["dora", "bias", "modules-to-save", "alpha-pattern", "rank", "rank-pattern", "not-lora"],
)
def test_adapter_configs_it_cannot_apply_are_refused(bert, changes, words):
    root, model_dir = bert
    adapter = edit_adapter_config(_adapter(root, model_dir, "bad"), **changes)
    _spec_refuses(model_dir, "bad", adapter, *words)


def test_pickle_weights_are_refused(bert):
    root, model_dir = bert
    adapter = _adapter(root, model_dir, "pickled")
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    _spec_refuses(model_dir, "pickled", adapter, "adapter_model.bin", "safetensors")


def test_a_missing_directory_is_refused(bert, tmp_path):
    _, model_dir = bert
    _spec_refuses(model_dir, "gone", tmp_path / "nowhere", "adapter_config.json")


def test_an_adapter_of_another_model_is_refused_naming_its_target(bert, tmp_path):
    _, model_dir = bert
    mpnet = build_classic_encoder(tmp_path, "mpnet", "mean")
    adapter = build_adapter(mpnet, tmp_path / "mpnet-adapter", 1, r=4, lora_alpha=8, target_modules=list(MPNET_TARGETS))
    _load_refuses(model_dir, "foreign", adapter, "attention.attn.", "no linear layer")


def test_head_and_embedding_targets_are_refused(bert):
    root, model_dir = bert
    _load_refuses(
        model_dir,
        "pooler",
        _adapter(root, model_dir, "pooler", target_modules=["pooler.dense"]),
        "pooler.dense",
        "head or pooler",
    )
    _load_refuses(model_dir, "emb", _adapter(root, model_dir, "emb", target_modules=["word_embeddings"]), "embedding")


def test_generating_models_and_uncovered_families_are_refused(bert, tiny_generator, tmp_path):
    root, model_dir = bert
    adapter = _adapter(root, model_dir, "ok")
    _spec_refuses(tiny_generator("llama"), "ok", adapter, "generates text")
    distilbert = build_classic_encoder(tmp_path, "distilbert", "mean")
    _spec_refuses(distilbert, "ok", adapter, "distilbert", "bert, mpnet")


def test_adapter_names_must_be_unique_across_served_models(bert):
    root, model_dir = bert
    adapter = _adapter(root, model_dir, "ok")
    with pytest.raises(ConfigError, match="unique; repeated: m .LoRA"):
        ServerConfig(models=(_config(model_dir, "m", adapter),))
    with pytest.raises(ConfigError, match="without ':'"):
        _config(model_dir, "m:x", adapter)
