"""The decoder's parts against transformers' own: rotary frequencies and tables, config switches, loading."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models.families import llama
from embedserv.models.families.llama import LlamaModel
from embedserv.models.loading.weights import load_weights
from embedserv.models.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies, rope_parameters
from tests.helpers.models import LINEAR_ROPE, LLAMA3_ROPE, load_in_process

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
ROPES = [None, LINEAR_ROPE, LLAMA3_ROPE]


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3"])
def test_cos_sin_and_rotation_equal_transformers(rope):
    config = LlamaConfig(max_position_embeddings=256, rope_parameters=dict(rope) if rope else None, **SMALL)
    reference = LlamaRotaryEmbedding(config)
    params = rope_parameters(config)
    assert torch.equal(inverse_frequencies(params, 16), reference.inv_freq)

    positions = torch.tensor([0, 1, 2, 3, 0, 1, 200, 255, 17])
    x = torch.randn(len(positions), 4, 16, generator=torch.Generator().manual_seed(0))
    cos_ref, sin_ref = reference(x, positions[None])
    cos, sin = RotaryEmbedding(config, 16, 256)(positions)
    torch.testing.assert_close(torch.cat((cos, cos), dim=-1)[:, 0], cos_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat((sin, sin), dim=-1)[:, 0], sin_ref[0], rtol=0, atol=0)

    expected, _ = apply_rotary_pos_emb(x, x, cos_ref[0], sin_ref[0], unsqueeze_dim=1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_rotation_runs_in_float32():
    positions = torch.arange(8)
    config = LlamaConfig(**SMALL)
    cos, sin = RotaryEmbedding(config, 16, 8)(positions)
    x = torch.randn(8, 2, 16)
    out = apply_rotary(x.bfloat16(), cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, apply_rotary(x.bfloat16().float(), cos, sin).bfloat16(), rtol=0, atol=0)


def test_configs_of_older_transformers_are_read():
    """No rope_parameters attribute: `rope_scaling` (old `type` key) and a top-level `rope_theta`."""
    config = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1234.0)
    assert rope_parameters(config) == {"type": "linear", "factor": 2.0, "rope_theta": 1234.0, "rope_type": "linear"}
    plain = rope_parameters(SimpleNamespace(max_position_embeddings=8))
    assert plain == {"rope_type": "default", "rope_theta": 10_000.0}
    llama3 = rope_parameters(
        SimpleNamespace(
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            max_position_embeddings=4096,
        )
    )
    assert llama3["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_other_rope_types_are_refused_naming_the_supported(rope_type):
    config = SimpleNamespace(rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError) as err:
        rope_parameters(config)
    assert rope_type in str(err.value)
    for supported in ("default", "linear", "llama3"):
        assert supported in str(err.value)


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        (MistralConfig(max_position_embeddings=512, sliding_window=100, **SMALL), [100, 100]),
        (MistralConfig(max_position_embeddings=512, sliding_window=None, **SMALL), [None, None]),
        # Qwen2 ignores the window unless use_sliding_window, and then only on layers past max_window_layers.
        (Qwen2Config(max_position_embeddings=512, sliding_window=100, **SMALL), [None, None]),
        (Qwen2Config(max_position_embeddings=512, sliding_window=100, use_sliding_window=True, **SMALL), [None, None]),
        (
            Qwen2Config(
                max_position_embeddings=512, sliding_window=100, use_sliding_window=True, max_window_layers=1, **SMALL
            ),
            [None, 100],
        ),
    ],
    ids=["mistral", "mistral-no-window", "qwen2-off", "qwen2-no-sliding-layer", "qwen2-sliding"],
)
def test_sliding_windows_are_per_layer_masks_not_a_length_cap(config, windows):
    """Inputs may be as long as the positions allow; the layers that slide attend within their window."""
    with torch.device("meta"):
        model = LlamaModel(config)
    assert model.max_positions == 512
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == windows


def _causal_lm_state(config: LlamaConfig) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).state_dict()


def test_load_weights_fills_every_parameter_and_skips_the_lm_head():
    config = LlamaConfig(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, **SMALL)
    state = _causal_lm_state(config)
    state["model.rotary_emb.inv_freq"] = torch.ones(8)
    model = LlamaModel(config)

    loaded = load_weights(model, llama.FAMILY, state.items())

    assert loaded == set(dict(model.named_parameters()))
    attn = model.layers[1].self_attn
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv")
    assert torch.equal(attn.qkv.bias, torch.cat((q, k, v)))
    gate, up = (state[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(model.layers[1].mlp.gate_up.weight, torch.cat((gate, up)))


def test_a_missing_shard_leaves_the_fused_parameter_unfilled():
    config = LlamaConfig(**SMALL)
    state = {k: v for k, v in _causal_lm_state(config).items() if k != "model.layers.0.self_attn.v_proj.weight"}
    loaded = load_weights(LlamaModel(config), llama.FAMILY, state.items())
    assert "layers.0.self_attn.qkv.weight" not in loaded
    assert "layers.1.self_attn.qkv.weight" in loaded


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.9.self_attn.q_proj.weight",
        "model.layers.0.mlp.fc1.weight",
        "vision_tower.weight",
    ],
)
def test_unexpected_tensors_are_refused(name):
    model = LlamaModel(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="unexpected checkpoint tensor"):
        load_weights(model, llama.FAMILY, [(name, torch.zeros(4))])


def test_a_tensor_of_the_wrong_shape_is_refused():
    model = LlamaModel(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, llama.FAMILY, [("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, llama.FAMILY, [("norm.weight", torch.zeros(1))])


def test_an_unsupported_rope_type_stops_loading_with_a_config_error(tiny_decoder, tmp_path):
    """The model class's ValueError reaches the user as a start-up error naming the directory."""
    model_dir = tmp_path / "yarn"
    shutil.copytree(tiny_decoder("llama", "lasttoken"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    config.pop("rope_scaling", None)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_in_process(ModelConfig(path=str(model_dir), served_name="m"))
    assert str(model_dir) in str(err.value) and "yarn" in str(err.value)
