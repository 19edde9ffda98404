"""Gemma 3 and 4 parts against transformers' own: rotary settings per layer type, causality, windows, the
KV-sharing layout, weight loading, refused configs, other Gemma 4 variants and the prefill-skip hook.

Configs are built in the test (tests/helpers/gemma_models.py) and models run KV-free on the naive backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM, Gemma4TextModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import attention_layers
from embedserv.attention.metadata import build_common_metadata, build_suffix_metadata
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.models import registry
from embedserv.models.families.gemma import Gemma3Model
from embedserv.models.families.gemma4 import Gemma4Model
from embedserv.models.loading.weights import load_weights
from embedserv.models.rotary import inverse_frequencies, rope_parameters
from embedserv.worker.layer_routes import forward_context_for
from embedserv.worker.prefill_skip import PrefillSkip
from tests.helpers.gemma_models import GEMMA3_WINDOW, GEMMA4_WINDOW, gemma3_config, gemma4_config

VOCAB = 512
LENGTHS = [5, 37, 1, 23]


def _state(model_class, config, seed: int = 0) -> dict[str, torch.Tensor]:
    from tests.helpers.gemma_models import _perturb

    torch.manual_seed(seed)
    model = model_class(config).eval()
    _perturb(model, seed)
    return model.state_dict()


def _loaded(model_class, config, state) -> torch.nn.Module:
    model = model_class(config)
    loaded = load_weights(model, registry.lookup(config.model_type), state.items())
    assert set(dict(model.named_parameters())) <= loaded
    return model.eval().requires_grad_(False)


def _packed(lengths, vocab: int = VOCAB):
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    return sequences, torch.cat(sequences), torch.cat([torch.arange(n) for n in lengths])


def _context(model, lengths, causal: bool = True, skip: PrefillSkip | None = None) -> ForwardContext:
    backend = NaiveBackend()
    metadata = backend.build_metadata(build_common_metadata(np.array(lengths), is_causal=causal))
    return forward_context_for(model, backend, metadata, skip=skip)


def test_rotary_frequencies_per_layer_type_equal_transformers():
    """Gemma 3: default and linear; Gemma 4: default over 16 dims, proportional over 32 (a quarter rotates)."""
    g3, g4 = gemma3_config(VOCAB), gemma4_config(VOCAB)
    g3_reference, g4_reference = Gemma3RotaryEmbedding(g3), Gemma4TextRotaryEmbedding(g4)
    for kind in ("sliding_attention", "full_attention"):
        ours = inverse_frequencies(rope_parameters(g3, kind), 16)
        assert torch.equal(ours, getattr(g3_reference, f"{kind}_inv_freq")), kind
        size = g4.per_layer_config[kind].head_dim
        ours = inverse_frequencies(rope_parameters(g4, kind), size)
        assert torch.equal(ours, getattr(g4_reference, f"{kind}_inv_freq")), kind
    assert (inverse_frequencies(rope_parameters(g4, "full_attention"), 32) != 0).sum() == 4


@pytest.mark.parametrize(
    ("config", "causal"),
    [
        (gemma3_config(VOCAB), True),
        (gemma3_config(VOCAB, bidirectional=True), False),
        (gemma4_config(VOCAB), True),
        (gemma4_config(VOCAB, use_bidirectional_attention="vision"), True),
        (gemma4_config(VOCAB, use_bidirectional_attention="all"), False),
    ],
    ids=["gemma3", "embeddinggemma", "gemma4", "gemma4-vision", "gemma4-all"],
)
def test_causality_follows_use_bidirectional_attention(config, causal):
    entry = registry.lookup(config.model_type)
    assert registry.is_causal(config, entry) is causal
    assert registry.is_causal(config, entry, override="causal") is True
    assert registry.is_causal(config, entry, override="bidirectional") is False


@pytest.mark.parametrize(
    ("model_class", "config", "window"),
    [
        (Gemma3Model, gemma3_config(VOCAB), GEMMA3_WINDOW),
        (Gemma3Model, gemma3_config(VOCAB, bidirectional=True, sliding_window=512), 257),
        (Gemma4Model, gemma4_config(VOCAB), GEMMA4_WINDOW),
        (Gemma4Model, gemma4_config(VOCAB, use_bidirectional_attention="vision"), GEMMA4_WINDOW),
        (Gemma4Model, gemma4_config(VOCAB, use_bidirectional_attention="all", sliding_window=512), 258),
    ],
    ids=["gemma3", "embeddinggemma-512", "gemma4", "gemma4-vision", "gemma4-all-512"],
)
def test_windows_of_the_sliding_layers(model_class, config, window):
    """Causal: W = sliding_window. EmbeddingGemma's 512 is 257 once loaded, |q - kv| < 257: W = 257.
    Gemma 4 "all": 512 is 257 once loaded, |q - kv| <= 257: W = 258."""
    with torch.device("meta"):
        layers = attention_layers(model_class(config))
    expected = [window if kind == "sliding_attention" else None for kind in config.layer_types]
    assert [layer.sliding_window for layer in layers] == expected


def test_kv_sharing_layout():
    """Shared layers read the last non-shared layer of their type; one KV-cache group for every shape."""
    with torch.device("meta"):
        model = Gemma4Model(gemma4_config(VOCAB))
        plain = Gemma4Model(gemma4_config(VOCAB, num_kv_shared_layers=0))
    layers = attention_layers(model)
    assert [layer.kv_source_layer for layer in layers] == [None, None, None, 1, 1, 2]
    assert [layer.is_kv_source for layer in layers] == [False, True, True, False, False, False]
    assert [layer.kv_group for layer in layers] == [0] * 6
    assert [(layer.num_kv_heads, layer.head_size) for layer in layers] == [(2, 16), (2, 16), (1, 32)] * 2
    assert model.prefill_skip_layer == 3
    shared = model.layers[3]
    assert shared.self_attn.k_norm is None and shared.self_attn.qkv.weight.shape[0] == 4 * 16
    assert shared.mlp.down_proj.weight.shape[1] == 2 * model.layers[0].mlp.down_proj.weight.shape[1]
    assert plain.prefill_skip_layer is None
    assert all(layer.kv_source_layer is None for layer in attention_layers(plain))


def test_shared_layers_need_an_earlier_layer_of_their_type():
    config = gemma4_config(VOCAB, layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=5)
    with pytest.raises(ValueError), torch.device("meta"):
        Gemma4Model(config)


def test_refused_configs():
    with pytest.raises(ValueError, match="attn_logit_softcapping"), torch.device("meta"):
        Gemma3Model(gemma3_config(VOCAB, attn_logit_softcapping=50.0))
    moe = gemma4_config(VOCAB, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="MoE Gemma 4"), torch.device("meta"):
        Gemma4Model(moe)


def test_loading_ignores_shared_kv_tensors_and_takes_bare_names():
    """What transformers drops on load (a shared layer's k/v projections and norms) is skipped; backbone
    names without `model.` load too; a checkpoint without layer scalars keeps them at 1."""
    config = gemma4_config(VOCAB)
    state = _state(Gemma4ForCausalLM, config)
    state["model.layers.4.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    state["model.layers.5.self_attn.v_norm.weight"] = torch.zeros(32)
    bare = {name.removeprefix("model."): t for name, t in state.items() if "layer_scalar" not in name}
    model = _loaded(Gemma4Model, config, bare)
    assert all(float(layer.layer_scalar) == 1.0 for layer in model.layers)
    with pytest.raises(ValueError, match="unexpected checkpoint tensor"):
        # Layer 2 is a full layer whose values are its keys (attention_k_eq_v): it has no value projection.
        load_weights(
            Gemma4Model(config),
            registry.lookup(config.model_type),
            [("model.layers.2.self_attn.v_proj.weight", torch.zeros(32, 64))],
        )
    biased = gemma3_config(VOCAB, attention_bias=True)
    _loaded(Gemma3Model, biased, _state(Gemma3ForCausalLM, biased))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False, use_double_wide_mlp=False),
        dict(
            attention_k_eq_v=False,
            use_double_wide_mlp=False,
            layer_types=["sliding_attention", "full_attention"] * 3,
            num_kv_shared_layers=2,
        ),
    ],
    ids=["no-sharing-no-ple", "separate-values"],
)
def test_other_gemma4_variants_equal_transformers(overrides):
    config = gemma4_config(VOCAB, **overrides)
    state = _state(Gemma4TextModel, config)
    model = _loaded(Gemma4Model, config, state)
    reference = Gemma4TextModel(config).eval()
    reference.load_state_dict(state)
    sequences, ids, positions = _packed(LENGTHS)
    with torch.inference_mode(), set_forward_context(_context(model, LENGTHS)):
        hidden = model(ids, positions)
        for sequence, got in zip(sequences, hidden.split(LENGTHS), strict=True):
            expected = reference(input_ids=sequence[None]).last_hidden_state[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_prefill_skip_runs_the_shared_layers_on_the_kept_rows_only():
    """With a PrefillSkip routed and its rows handed to the model, the output is the full pass's rows at `rows`."""
    config = gemma4_config(VOCAB)
    model = _loaded(Gemma4Model, config, _state(Gemma4TextModel, config))
    _, ids, positions = _packed(LENGTHS)
    with torch.inference_mode(), set_forward_context(_context(model, LENGTHS)):
        full = model(ids, positions)

    # Keep each sequence's last token, and the whole of the first one.
    keep = np.array([LENGTHS[0], 1, 1, 1])
    ends = np.cumsum(LENGTHS)
    rows = torch.from_numpy(np.concatenate([np.arange(e - k, e) for e, k in zip(ends, keep, strict=True)]))
    cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(keep)]))
    cu_k = torch.from_numpy(np.concatenate([[0], ends]))
    backend = NaiveBackend()
    suffix = backend.build_metadata(build_suffix_metadata(keep, np.array(LENGTHS), cu_q, cu_k, is_causal=True))
    skip = PrefillSkip(first_layer=model.prefill_skip_layer, rows=rows, attn_metadata=(suffix,))
    with torch.inference_mode(), set_forward_context(_context(model, LENGTHS, skip=skip)):
        kept = model(ids, positions, prefill_skip_rows=skip.rows)
    torch.testing.assert_close(kept, full[rows], atol=1e-5, rtol=0)
