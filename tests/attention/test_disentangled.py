"""DeBERTa's disentangled attention on every backend that can add it (naive, sdpa, flex), against
transformers' own DisentangledSelfAttention on the same projections, sequence by sequence: log buckets
and plain clamped distances, shared and separate position projections, c2p and p2c alone and together,
sequences past the bucket range. The flash kernels are refused for it, by the selector first."""

import math

import numpy as np
import pytest
import torch
from transformers import DebertaV2Config
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

from embedserv.attention.backends.base import refuse_score_bias
from embedserv.attention.backends.flex import FlexBackend
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.disentangled import DisentangledPositions, PositionProjections
from embedserv.attention.layer import Attention, AttentionKind
from embedserv.attention.metadata import build_common_metadata
from embedserv.attention.selector import AttentionSpec, select_backend, unsupported_reason
from embedserv.errors import ConfigError
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for

HEADS, HEAD_SIZE = 4, 16
# Runs of equal lengths, a single token, and lengths past every case's bucket range (max_distance).
LENS = [90, 40, 40, 7, 1]

# (position_buckets, max_relative_positions, share_att_key, pos_att_type)
CASES = {
    "v3-log-buckets-shared": (8, 32, True, ["p2c", "c2p"]),
    "plain-clamp-separate": (-1, 24, False, ["c2p", "p2c"]),
    "c2p-only": (8, 32, False, ["c2p"]),
    "p2c-only": (-1, 24, True, ["p2c"]),
}

BACKENDS = {"naive": NaiveBackend, "sdpa": SdpaBackend, "flex-eager": lambda: FlexBackend(compile=False)}


def reference_and_inputs(case: str, seed: int = 0, std: float = 0.3):
    buckets, max_relative, share, pos_att_type = CASES[case]
    config = DebertaV2Config(
        hidden_size=HEADS * HEAD_SIZE,
        num_attention_heads=HEADS,
        relative_attention=True,
        position_buckets=buckets,
        max_relative_positions=max_relative,
        share_att_key=share,
        pos_att_type=pos_att_type,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    reference = DisentangledSelfAttention(config).eval()
    for parameter in reference.parameters():
        torch.nn.init.normal_(parameter, std=std)
    span = reference.pos_ebd_size
    hidden = torch.randn(sum(LENS), config.hidden_size)
    rel_embeddings = torch.randn(2 * span, config.hidden_size)
    return reference, hidden, rel_embeddings, DisentangledPositions(buckets, max_relative)


def expected_output(reference, hidden, rel_embeddings) -> torch.Tensor:
    """transformers, one sequence at a time (no padding), -> [tokens, heads * head_size]."""
    outs, start = [], 0
    with torch.no_grad():
        for length in LENS:
            mask = torch.ones(1, 1, length, length, dtype=torch.bool)
            out, _ = reference(hidden[None, start : start + length], mask, rel_embeddings=rel_embeddings)
            outs.append(out[0])
            start += length
    return torch.cat(outs)


def ours(backend, reference, hidden, rel_embeddings, disentangled, dtype=torch.float32) -> torch.Tensor:
    share, terms = reference.share_att_key, reference.pos_att_type
    scale = 1 / math.sqrt(HEAD_SIZE * (1 + len(terms)))
    layer = Attention(HEADS, HEAD_SIZE, scale=scale, kind=AttentionKind.ENCODER, disentangled=disentangled)
    with torch.no_grad():
        q, k, v = (proj(hidden).to(dtype) for proj in (reference.query_proj, reference.key_proj, reference.value_proj))
        key_proj = reference.key_proj if share else getattr(reference, "pos_key_proj", None)
        query_proj = reference.query_proj if share else getattr(reference, "pos_query_proj", None)
        positions = PositionProjections(
            keys=key_proj(rel_embeddings).to(dtype) if "c2p" in terms else None,
            queries=query_proj(rel_embeddings).to(dtype) if "p2c" in terms else None,
        )
    common = build_common_metadata(np.array(LENS), is_causal=False)
    context = forward_context_for([layer], backend, backend.build_metadata(common))
    with torch.inference_mode(), set_forward_context(context):
        return layer(q, k, v, positions).float()


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_backend_equals_transformers(name, case):
    reference, hidden, rel_embeddings, disentangled = reference_and_inputs(case)
    expected = expected_output(reference, hidden, rel_embeddings)
    actual = ours(BACKENDS[name](), reference, hidden, rel_embeddings, disentangled)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_the_bias_changes_the_output():
    """The check above can fail: dropping the position projections' contribution moves the output."""
    reference, hidden, rel_embeddings, disentangled = reference_and_inputs("v3-log-buckets-shared")
    expected = expected_output(reference, hidden, rel_embeddings)
    far = DisentangledPositions(disentangled.position_buckets, disentangled.max_relative_positions * 4)
    actual = ours(SdpaBackend(), reference, hidden, rel_embeddings, far)
    assert (actual - expected).abs().max() > 1e-3


def test_sdpa_bfloat16_equals_the_oracle():
    """bfloat16 inputs: sdpa (float32 bias, bfloat16 kernel) against the naive oracle (float32 throughout),
    with scores of a trained model's size (a few units; std 0.3 makes them tens, where bfloat16 q . k alone
    moves outputs by 0.1)."""
    args = reference_and_inputs("v3-log-buckets-shared", std=0.1)
    expected = ours(NaiveBackend(), *args, torch.bfloat16)
    actual = ours(SdpaBackend(), *args, torch.bfloat16)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def test_sdpa_cuts_long_runs_into_groups(monkeypatch):
    """A run whose masks pass the byte bound goes in several groups, with the same result."""
    from embedserv.attention.backends import sdpa_bias

    reference, hidden, rel_embeddings, disentangled = reference_and_inputs("plain-clamp-separate")
    expected = expected_output(reference, hidden, rel_embeddings)
    monkeypatch.setattr(sdpa_bias, "_DISENTANGLED_BYTES", HEADS * 40 * 40 * 4)
    groups = sdpa_bias.disentangled_groups(sdpa_bias.Run(token_start=90, num_seqs=2, length=40), HEADS)
    assert [(g.token_start, g.num_seqs) for g in groups] == [(90, 1), (130, 1)]
    actual = ours(SdpaBackend(), reference, hidden, rel_embeddings, disentangled)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_compiled_flex_equals_transformers():
    reference, hidden, rel_embeddings, disentangled = reference_and_inputs("v3-log-buckets-shared")
    expected = expected_output(reference, hidden, rel_embeddings)
    actual = ours(FlexBackend(), reference, hidden, rel_embeddings, disentangled)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def _spec(device, **kwargs):
    return AttentionSpec(torch.device(device), torch.bfloat16, 64, 8, 8, is_causal=False, **kwargs)


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_flash_kernels_are_refused_first(name, device):
    """The disentangled reason comes before the device and package checks (no GPU needed to ask)."""
    reason = unsupported_reason(name, _spec(device, disentangled=True))
    assert reason is not None and "disentangled" in reason and "sdpa, flex or naive" in reason
    with pytest.raises(ConfigError, match=f"--attention-backend {name} cannot run here: .*disentangled"):
        select_backend(name, _spec(device, disentangled=True))


def test_cpu_backends_accept_it_and_refuse_a_window():
    for name in ("sdpa", "flex", "naive"):
        assert unsupported_reason(name, _spec("cpu", disentangled=True)) is None
        assert "disentangled" in unsupported_reason(name, _spec("cpu", disentangled=True, sliding_window=True))
    assert select_backend(None, _spec("cpu", disentangled=True)).name == "sdpa"


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
def test_flash_kernels_raise_if_a_disentangled_layer_reaches_them(name):
    layer = Attention(4, 16, kind=AttentionKind.ENCODER, disentangled=DisentangledPositions(8, 32))
    with pytest.raises(NotImplementedError, match="disentangled"):
        refuse_score_bias(layer, name)
    refuse_score_bias(Attention(4, 16), name)


def test_the_layer_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match="encoder layers"):
        Attention(4, 16, kind=AttentionKind.DECODER, disentangled=DisentangledPositions(8, 32))
    with pytest.raises(ValueError, match="encoder layers"):
        Attention(4, 16, kind=AttentionKind.ENCODER, sliding_window=4, disentangled=DisentangledPositions(8, 32))
