"""models/rotary.py's inverse frequencies against the reference implementations: transformers' own rope init
functions for the types it has, and for "ntk" (GTE v1.5's `rope_scaling: {"type": "ntk"}`, which transformers
5.23 lacks) Alibaba-NLP/new-impl's NTKScalingRotaryEmbedding formula, transcribed below."""

from __future__ import annotations

import pytest
import torch

from embedserv.models.rotary import inverse_frequencies, rope_parameters


def _gte_config(rope_parameters: dict):
    from transformers import GteConfig

    return GteConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=rope_parameters
    )


def _new_impl_inv_freq(dim: int, base: float, scaling_factor: float, mixed_b: float | None) -> torch.Tensor:
    """new-impl's NTKScalingRotaryEmbedding._set_cos_sin_cache, the branch taken past max_position_embeddings
    (always: its cache is built for max_position_embeddings * scaling_factor)."""
    base = base * (scaling_factor if mixed_b is None else 1)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    if mixed_b is None:
        return inv_freq / scaling_factor ** (2 / dim)
    a = torch.tensor(scaling_factor).log() / (dim / 2) ** mixed_b
    lambda_1_m = (a * torch.arange(1, dim // 2 + 1).float() ** mixed_b).exp()
    return inv_freq / lambda_1_m


@pytest.mark.parametrize("mixed_b", [None, 0.625])
@pytest.mark.parametrize(("factor", "theta", "dim"), [(2.0, 500_000.0, 64), (4.0, 10_000.0, 16)])
def test_ntk_equals_new_impl(factor, theta, dim, mixed_b):
    params = {"rope_type": "ntk", "factor": factor, "rope_theta": theta}
    if mixed_b is not None:
        params["mixed_b"] = mixed_b
    config = _gte_config(dict(params))

    ours = inverse_frequencies(rope_parameters(config), dim)

    torch.testing.assert_close(ours, _new_impl_inv_freq(dim, theta, factor, mixed_b), rtol=0, atol=0)
    # Scaling slows every frequency (the first pair too: factor ** (2 / dim) > 1).
    plain = inverse_frequencies({"rope_type": "default", "rope_theta": theta}, dim)
    assert bool((ours < plain).all())


def test_ntk_is_not_a_transformers_rope_type():
    """If transformers gains an "ntk" type, compare against its init function instead of the transcription."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert "ntk" not in ROPE_INIT_FUNCTIONS


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 20_000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500_000.0,
        },
    ],
)
def test_other_types_equal_transformers_init_functions(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _gte_config(dict(params))
    theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")

    torch.testing.assert_close(inverse_frequencies(rope_parameters(config), 16), theirs, rtol=0, atol=0)


def test_ntk_needs_a_factor():
    with pytest.raises(ValueError, match="factor"):
        inverse_frequencies({"rope_type": "ntk", "rope_theta": 1e4}, 16)
