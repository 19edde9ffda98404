"""What embedserv loads from a model directory: safetensors always, pickles only with allow_pickle and then
tensors only, and never the code a directory ships.

Every model here is a copy of one tiny random BERT (tests/helpers/models.py), its weights rewritten in the
format under test. Payloads that would run code create a marker file; a test proves each payload live
by running it the unsafe way after embedserv refused it.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from embedserv.config import ModelConfig
from embedserv.engine.served_model import read_served_model
from embedserv.engine.sync import SyncEngine
from embedserv.errors import ConfigError
from embedserv.models.loading.checkpoint import checkpoint_files
from tests.helpers.models import load_in_process

TEXTS = ["the cat sat on the mat", "a pickle is a program", "safetensors holds only tensors"]


class _RunsCode:
    """Pickles to a call of exec: whoever unpickles it with the full unpickler runs `source`."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self):
        return exec, (self.source,)


def _touch_source(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


@pytest.fixture(scope="module")
def safetensors_dir(tiny_encoder) -> Path:
    return tiny_encoder("bert", "mean")


@pytest.fixture(scope="module")
def expected(safetensors_dir) -> np.ndarray:
    return _embed(safetensors_dir)


def _embed(model_dir: Path, allow_pickle: bool = False, worker_processes: bool = False) -> np.ndarray:
    # warm_up=False in the config too: worker processes read it there.
    config = ModelConfig(path=str(model_dir), served_name="m", allow_pickle=allow_pickle, warm_up=False)
    with SyncEngine(config, warm_up=False, worker_processes=worker_processes) as engine:
        return engine.embed(TEXTS).embeddings


def _copy_without_weights(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    return target


def _pickle_copy(source: Path, target: Path, layout: str) -> Path:
    """The model with its weights in pytorch_model.bin: one zip file, two shards and an index, or the
    legacy (pre-zip) format, which torch cannot memory-map."""
    model_dir = _copy_without_weights(source, target)
    state = load_file(str(source / "model.safetensors"))
    if layout == "single":
        torch.save(state, model_dir / "pytorch_model.bin")
    elif layout == "legacy":
        torch.save(state, model_dir / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    else:
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        weight_map = {}
        for shard, shard_names in halves.items():
            torch.save({n: state[n] for n in shard_names}, model_dir / shard)
            weight_map.update(dict.fromkeys(shard_names, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (model_dir / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return model_dir


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_pickle_only_model_is_refused_without_allow_pickle(safetensors_dir, tmp_path, layout):
    model_dir = _pickle_copy(safetensors_dir, tmp_path / "pickled", layout)
    with pytest.raises(ConfigError) as caught:
        read_served_model(ModelConfig(path=str(model_dir), served_name="m"))
    message = str(caught.value)
    assert "--allow-pickle" in message and "pickle" in message and "run code" in message
    assert "safetensors" in message, "the refusal should say to convert to safetensors"


@pytest.mark.parametrize("layout", ["single", "sharded", "legacy"])
def test_allowed_pickle_embeds_exactly_as_safetensors(safetensors_dir, expected, tmp_path, layout):
    model_dir = _pickle_copy(safetensors_dir, tmp_path / "pickled", layout)
    assert np.array_equal(_embed(model_dir, allow_pickle=True), expected)


def test_allowed_pickle_reaches_worker_processes(safetensors_dir, expected, tmp_path):
    """Worker processes read the checkpoint themselves; allow_pickle must travel with their config."""
    model_dir = _pickle_copy(safetensors_dir, tmp_path / "pickled", "single")
    assert np.array_equal(_embed(model_dir, allow_pickle=True, worker_processes=True), expected)


def test_pickle_that_runs_code_is_refused_even_with_allow_pickle(safetensors_dir, tmp_path):
    marker = tmp_path / "pwned"
    model_dir = _copy_without_weights(safetensors_dir, tmp_path / "malicious")
    state = dict(load_file(str(safetensors_dir / "model.safetensors")))
    state["payload"] = _RunsCode(_touch_source(marker))
    torch.save(state, model_dir / "pytorch_model.bin")

    with pytest.raises(ConfigError) as caught:
        load_in_process(ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True))
    message = str(caught.value)
    assert "refused, even with --allow-pickle" in message and "GLOBAL" in message and "safetensors" in message
    assert "weights_only` set to `False`" not in message, "torch's advice to load it unsafely is not ours to give"
    assert not marker.exists(), "loading the checkpoint ran its code"

    # The control: the payload is live, the full unpickler runs it.
    torch.load(model_dir / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_safetensors_wins_over_a_pickle_beside_it(safetensors_dir, expected, tmp_path):
    """Many published models carry both; the pickle is not even opened."""
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "both"
    shutil.copytree(safetensors_dir, model_dir)
    torch.save({"payload": _RunsCode(_touch_source(marker))}, model_dir / "pytorch_model.bin")
    assert checkpoint_files(model_dir, allow_pickle=True) == [model_dir / "model.safetensors"]
    assert np.array_equal(_embed(model_dir), expected)
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_damaged_pickle_is_a_config_error(safetensors_dir, tmp_path, legacy):
    model_dir = _pickle_copy(safetensors_dir, tmp_path / "damaged", "legacy" if legacy else "single")
    path = model_dir / "pytorch_model.bin"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="pytorch_model.bin"):
        load_in_process(ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True))


def test_pickle_of_something_else_than_a_state_dict_is_refused(safetensors_dir, tmp_path):
    model_dir = _copy_without_weights(safetensors_dir, tmp_path / "list")
    torch.save([torch.zeros(2)], model_dir / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="holds a list, not a state dict"):
        load_in_process(ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True))


def test_directory_without_weights_says_what_is_missing(safetensors_dir, tmp_path):
    model_dir = _copy_without_weights(safetensors_dir, tmp_path / "empty")
    with pytest.raises(ConfigError, match="neither model.safetensors .* nor pytorch_model.bin"):
        read_served_model(ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True))


def _write_custom_code(model_dir: Path, marker: Path) -> None:
    """A module that creates `marker` when imported, with the classes the auto_map entries name (valid
    ones, so transformers would succeed in using them if it imported the module)."""
    source = (
        _touch_source(marker)
        + "\n"
        + (
            "from transformers import BertConfig, BertModel, BertTokenizerFast\n"
            "class CustomConfig(BertConfig):\n    pass\n"
            "class CustomModel(BertModel):\n    config_class = CustomConfig\n"
            "class CustomTokenizer(BertTokenizerFast):\n    pass\n"
        )
    )
    (model_dir / "custom_code.py").write_text(source)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_auto_map_code_is_never_imported_and_the_native_model_serves(safetensors_dir, expected, tmp_path, caplog):
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "custom"
    shutil.copytree(safetensors_dir, model_dir)
    _write_custom_code(model_dir, marker)
    _edit_json(
        model_dir / "config.json",
        auto_map={"AutoConfig": "custom_code.CustomConfig", "AutoModel": "custom_code.CustomModel"},
    )
    _edit_json(
        model_dir / "tokenizer_config.json",
        auto_map={"AutoTokenizer": ["custom_code.CustomTokenizer", "custom_code.CustomTokenizer"]},
    )
    with caplog.at_level(logging.WARNING, logger="embedserv"):
        assert np.array_equal(_embed(model_dir), expected)
    assert not marker.exists(), "serving the model imported its custom code"
    assert any("never runs it" in r.getMessage() for r in caplog.records), "no warning that auto_map is ignored"


def test_model_type_that_exists_only_as_custom_code_is_refused(safetensors_dir, tmp_path):
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "custom-type"
    shutil.copytree(safetensors_dir, model_dir)
    _write_custom_code(model_dir, marker)
    _edit_json(
        model_dir / "config.json",
        model_type="custom-bert",
        auto_map={"AutoConfig": "custom_code.CustomConfig", "AutoModel": "custom_code.CustomModel"},
    )
    with pytest.raises(ConfigError) as caught:
        read_served_model(ModelConfig(path=str(model_dir), served_name="m"))
    message = str(caught.value)
    assert "'custom-bert' is not supported" in message and "never runs" in message
    assert "bert" in message.split("supported:")[-1], "the refusal should list the supported model types"
    assert not marker.exists()


def test_custom_sentence_transformers_module_is_refused_not_imported(safetensors_dir, tmp_path):
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "custom-module"
    shutil.copytree(safetensors_dir, model_dir)
    _write_custom_code(model_dir, marker)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": "2", "path": "", "type": "custom_code.CustomModule"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="custom_code.CustomModule is custom code"):
        read_served_model(ModelConfig(path=str(model_dir), served_name="m"))
    assert not marker.exists()


def test_a_custom_module_named_like_ours_is_refused_not_taken_for_ours(safetensors_dir, tmp_path):
    """`my_package.Pooling` may pool differently: serving it with our Pooling would give wrong embeddings."""
    model_dir = tmp_path / "lookalike"
    shutil.copytree(safetensors_dir, model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    for module in modules:
        if module["type"].endswith(".Pooling"):
            module["type"] = "my_package.Pooling"
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="my_package.Pooling is custom code"):
        read_served_model(ModelConfig(path=str(model_dir), served_name="m"))


def test_dense_layer_follows_the_same_policy(tmp_path):
    """A sentence-transformers Dense folder with only pytorch_model.bin: refused, or with allow_pickle loaded."""
    from embedserv.models.heads.pooling import Dense
    from embedserv.models.loading.st_files import DenseSpec
    from embedserv.models.loading.weights import load_dense_weights

    spec = DenseSpec(in_features=4, out_features=2, bias=True, activation="Tanh", directory=tmp_path)
    weights = {"linear.weight": torch.randn(2, 4), "linear.bias": torch.randn(2)}
    torch.save(weights, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="--allow-pickle"):
        load_dense_weights(Dense(spec), tmp_path)
    layer = Dense(spec)
    load_dense_weights(layer, tmp_path, allow_pickle=True)
    assert torch.equal(layer.linear.weight, weights["linear.weight"])
    assert torch.equal(layer.linear.bias, weights["linear.bias"])


def test_allowed_pickle_serves_a_classifier_head_exactly_as_safetensors(tmp_path):
    """The score head is read beside the body: from the pickle too (it once opened it as safetensors)."""
    from tests.helpers.scorers import build_cross_encoder

    source = build_cross_encoder(tmp_path / "st", "bert", num_labels=3)
    pickled = _pickle_copy(source, tmp_path / "pickled", "single")

    def scores(model_dir: Path) -> np.ndarray:
        config = ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True)
        with SyncEngine(config, warm_up=False) as engine:
            return engine.classify(TEXTS).scores

    assert np.array_equal(scores(pickled), scores(source))


def test_allowed_pickle_finds_an_untied_lm_head(tmp_path):
    from embedserv.types import SamplingParams
    from tests.helpers.models import build_tiny_generator

    source = build_tiny_generator(tmp_path / "gen", "llama", tie_word_embeddings=False)
    pickled = _pickle_copy(source, tmp_path / "pickled", "single")

    def tokens(model_dir: Path) -> list[int]:
        config = ModelConfig(path=str(model_dir), served_name="m", allow_pickle=True)
        with SyncEngine(config, warm_up=False) as engine:
            deltas = engine.generate("the first words", SamplingParams(max_tokens=8, temperature=0.0))
        return [t for d in deltas for t in d.token_ids]

    assert tokens(pickled) == tokens(source)
    assert len(tokens(pickled)) == 8


def test_a_custom_transformer_module_is_read_only_for_the_family_that_declares_it(safetensors_dir, tmp_path):
    """custom_st.Transformer is jina-embeddings-v3's wrapper (its family reads it as Transformer); in a BERT
    directory it is custom code like any other, refused and not imported."""
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "custom-transformer"
    shutil.copytree(safetensors_dir, model_dir)
    (model_dir / "custom_st.py").write_text(_touch_source(marker))
    modules = json.loads((model_dir / "modules.json").read_text())
    modules[0]["type"] = "custom_st.Transformer"
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="custom_st.Transformer is custom code"):
        read_served_model(ModelConfig(path=str(model_dir), served_name="m"))
    assert not marker.exists()
