"""M-RoPE in models/rotary.py against transformers' Qwen2-VL rotary embedding and apply_rotary_pos_emb: each
frequency section rotates by its own position row; equal rows (text) give plain RoPE's bits. Qwen3-VL's
interleaved layout against Qwen3VLTextRotaryEmbedding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from embedserv.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters

HEAD_DIM = 32
SECTION = [4, 6, 6]


def _config(rope: dict):
    from transformers import Qwen2VLTextConfig

    return Qwen2VLTextConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope
    )


def _positions(seed: int, tokens: int = 40) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (3, tokens), generator=generator)


@pytest.mark.parametrize("seed", [0, 1])
def test_sections_rotate_as_transformers(seed):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    config = _config({"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION})
    positions = _positions(seed)
    x = torch.randn(positions.shape[1], 4, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 7))
    ours = RotaryEmbedding(config, HEAD_DIM, 256)
    got = apply_rotary(x, *ours(positions))
    cos, sin = Qwen2VLRotaryEmbedding(config)(x, positions[:, None, :])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=0, atol=1e-6)
    # Each section reads its own row: moving one row's positions changes only its section's frequencies.
    moved = positions.clone()
    moved[1] += 3
    cos_moved, _ = ours(moved)
    cos_now, _ = ours(positions)
    changed = (cos_moved != cos_now).any(dim=0).any(dim=0)
    assert changed.nonzero().flatten().tolist() == list(range(SECTION[0], SECTION[0] + SECTION[1]))


@pytest.mark.parametrize(("head_dim", "section"), [(HEAD_DIM, SECTION), (128, [24, 20, 20]), (16, [2, 3, 3])])
def test_interleaved_sections_rotate_as_qwen3_vl(head_dim, section):
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

    rope = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": section, "mrope_interleaved": True}
    config = Qwen3VLTextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=256, rope_parameters=rope
    )
    positions = _positions(5)
    x = torch.randn(positions.shape[1], 4, head_dim, generator=torch.Generator().manual_seed(11))
    ours = RotaryEmbedding(config, head_dim, 256)
    got = apply_rotary(x, *ours(positions))
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(x, positions[:, None, :])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=0, atol=1e-5)
    flat = positions[0]
    for interleaved, plain in zip(ours(flat.expand(3, -1)), ours(flat), strict=True):
        assert torch.equal(interleaved, plain)


def test_equal_rows_are_plain_rope_bit_for_bit():
    config = _config({"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": SECTION})
    rotary = RotaryEmbedding(config, HEAD_DIM, 256)
    flat = _positions(3)[0]
    for got, plain in zip(rotary(flat.expand(3, -1)), rotary(flat), strict=True):
        assert torch.equal(got, plain)


def test_config_json_mrope_type_reads_as_default_frequencies():
    """Qwen2-VL's config.json says `rope_scaling: {"type": "mrope", ...}`; transformers reads it as default."""
    config = SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": SECTION}, rope_theta=1e6)
    params = rope_parameters(config)
    assert (params["rope_type"], params["rope_theta"], params["mrope_section"]) == ("default", 1e6, SECTION)


def test_refusals():
    with pytest.raises(ValueError, match="three sizes adding up to half the head size, 16"):
        RotaryEmbedding(_config({"rope_type": "default", "mrope_section": [4, 6, 8]}), HEAD_DIM, 256)
    plain = RotaryEmbedding(_config({"rope_type": "default"}), HEAD_DIM, 256)
    with pytest.raises(ValueError, match="no mrope_section"):
        plain(_positions(0))
