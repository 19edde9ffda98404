"""T5's relative position bias on every backend that can add one (naive, sdpa, flex), against the naive
oracle: a per-head score by clamped distance, bidirectional and causal, KV-free and paged, compiled flex
included; the flash kernels are refused for it. Also compiled flex over cross-attention."""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.base import refuse_relative_bias
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, cumulative_offsets
from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.attention.selector import AttentionSpec, select_backend, unsupported_reason
from embedserv.errors import ConfigError
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import COMPILED_FLEX_DEVICES, DEVICES, TOLERANCE, make_backend
from tests.attention.test_cross_and_bias import (
    CROSS_MIXES,
    HEADS_DTYPE_IDS,
    HEADS_DTYPES,
    PAGED_CROSS_MIXES,
    CrossStep,
    _paged_backend,
    _to,
    _tolerance,
    check_cross,
)
from tests.attention.test_paged_backends import MIXES, Step, _backend

# On CUDA sdpa adds T5's bias in bfloat16 (as transformers does; its kernels take no float32 mask with
# bfloat16 queries), which rounds biases of a few units by up to 0.02: one output in 10^5 then lies
# 0.025 from the float32 oracle.
BIAS_TOLERANCE = {**TOLERANCE, torch.bfloat16: 3e-2}


def _bias_tolerance(dtype):
    return dict(atol=BIAS_TOLERANCE[dtype], rtol=BIAS_TOLERANCE[dtype])


BIAS_BACKENDS = ["sdpa", "flex-eager"]
MAX_DISTANCE = 20
# Past max_distance, so the clamp matters; runs of equal lengths and a single token.
BIAS_LENS = [70, 50, 50, 23, 1]


def make_bias(heads, causal, device, seed=0):
    bias = RelativePositionBias(num_buckets=32, max_distance=MAX_DISTANCE, num_heads=heads, bidirectional=not causal)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        bias.relative_attention_bias.weight.copy_(torch.randn(32, heads, generator=gen) * 2)
    return bias.to(device)


def biased_layer(heads, kv_heads, head_size, bias, scale):
    return Attention(heads, head_size, scale=scale, num_kv_heads=kv_heads, relative_bias=bias)


def attend_biased(backend, lens, heads, kv_heads, head_size, causal, dtype, device, scale, bias, seed=0):
    """One KV-free self-attention layer with the bias; T5's scale 1.0 comes with queries of a matching size."""
    gen = torch.Generator().manual_seed(seed)
    q_std = head_size**-0.5 if scale == 1.0 else 1.0
    q = (torch.randn(sum(lens), heads * head_size, generator=gen) * q_std).to(device, dtype)
    k = torch.randn(sum(lens), kv_heads * head_size, generator=gen).to(device, dtype)
    v = torch.randn(sum(lens), kv_heads * head_size, generator=gen).to(device, dtype)
    layer = biased_layer(heads, kv_heads, head_size, bias, scale)
    common = build_common_metadata(np.array(lens), is_causal=causal, cu_seqlens=_to(cumulative_offsets(lens), device))
    context = forward_context_for([layer], backend, backend.build_metadata(common))
    with torch.inference_mode(), set_forward_context(context):
        return layer(q, k, v).float().cpu()


def check_bias(name, device, causal, heads, kv_heads, head_size, dtype, scale, lens=BIAS_LENS):
    backend = make_backend(name, device, dtype, head_size, heads, kv_heads, causal)
    bias = make_bias(heads, causal, device)
    args = (lens, heads, kv_heads, head_size, causal, dtype, device, scale, bias)
    expected = attend_biased(NaiveBackend(), *args)
    actual = attend_biased(backend, *args)
    torch.testing.assert_close(actual, expected, **_bias_tolerance(dtype))
    return actual


@pytest.mark.parametrize("name", BIAS_BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads,kv_heads,dtype", HEADS_DTYPES, ids=HEADS_DTYPE_IDS)
def test_kv_free_relative_bias_matches_naive(name, device, causal, heads, kv_heads, dtype):
    check_bias(name, device, causal, heads, kv_heads, 64, dtype, 1.0)


@pytest.mark.parametrize("name", BIAS_BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_relative_bias_is_added_after_scaling(name, device):
    """T5 scales by 1.0, which would hide a bias added before the scale: another scale shows it."""
    check_bias(name, device, True, 8, 2, 64, torch.float32, None)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_changes_the_answer_and_clamps_far_distances(device):
    """Sanity of the oracle the backends are held to: the bias matters, and it is the table's last entry
    for every distance past max_distance."""
    bias = make_bias(4, False, device)
    table = bias.distance_table()
    far = bias.bias(torch.tensor([0], device=device), torch.arange(60, device=device), table)
    torch.testing.assert_close(far[:, 0, MAX_DISTANCE:], table[:, -1:].expand(-1, 60 - MAX_DISTANCE))
    backend = make_backend("sdpa", device, torch.float32, 32, 4, 4, False)
    args = (BIAS_LENS, 4, 4, 32, False, torch.float32, device, 1.0)
    other = make_bias(4, False, device, seed=1)
    assert not torch.allclose(attend_biased(backend, *args, bias), attend_biased(backend, *args, other))


def _biased_step(mix, heads, kv_heads, head_size, dtype, device, block_size, bias, scale=1.0, unowned_fill=0.0):
    """A paged decoder self-attention step (test_paged_backends.Step) whose layer carries the bias."""
    step = Step(mix, heads, kv_heads, head_size, dtype, device, block_size, unowned_fill=unowned_fill)
    step.layer = biased_layer(heads, kv_heads, head_size, bias, scale)
    if scale == 1.0:
        step.q = step.q * head_size**-0.5
        step.qs = [q * head_size**-0.5 for q in step.qs]
    return step


PAGED_BIAS_MIXES = {
    # Prompts without context (their own keys), chunks with context, decodes; most past max_distance.
    "mixed": [(0, 45), (30, 1), (25, 30), (0, 7), (0, 1), (63, 1), (16, 16)],
    "decodes": MIXES["decodes"],
}


@pytest.mark.parametrize("name", ["naive", *BIAS_BACKENDS])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(PAGED_BIAS_MIXES))
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,dtype",
    [(16, 8, 2, torch.float32), (12, 8, 2, torch.bfloat16), (12, 4, 4, torch.float32)],
    ids=["16-gqa-fp32", "12-gqa-bf16", "12-mha-fp32"],
)
def test_paged_relative_bias_matches_full_causal_attention(name, device, mix, block_size, heads, kv_heads, dtype):
    backend, block_size = _paged_backend(name, device, dtype, 64, heads, kv_heads, block_size)
    bias = make_bias(heads, True, device)
    step = _biased_step(PAGED_BIAS_MIXES[mix], heads, kv_heads, 64, dtype, device, block_size, bias)
    with torch.inference_mode():
        out = step.run(backend)
        torch.testing.assert_close(out, step.full_causal(), **_bias_tolerance(dtype))
        # A layer sharing this cache (no keys of its own) and the stack's bias gives the same answer.
        torch.testing.assert_close(step.run(backend, shared=True), out, **_tolerance(dtype))


@pytest.mark.parametrize("name", ["naive", *BIAS_BACKENDS])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_relative_bias_sees_only_its_own_blocks(name, device):
    backend, _ = _backend(name, device, torch.float32, 32, 4, 4, 12)
    runs = []
    for fill in (0.0, 1e4):
        step = _biased_step(
            PAGED_BIAS_MIXES["mixed"],
            4,
            4,
            32,
            torch.float32,
            device,
            12,
            make_bias(4, True, device),
            unowned_fill=fill,
        )
        with torch.inference_mode():
            runs.append(step.run(backend))
    torch.testing.assert_close(runs[1], runs[0], atol=0, rtol=0)


def test_the_stack_shares_one_table_a_step():
    """The distance table and the masks built from it are made by the step's first layer of a stack and
    reused by the others (sdpa and flex keep them in the step's metadata)."""
    from embedserv.attention.backends.flex import FlexBackend
    from embedserv.attention.backends.sdpa import SdpaBackend

    bias = make_bias(4, False, "cpu")
    calls = []
    original = bias.distance_table
    bias.distance_table = lambda: calls.append(1) or original()
    for backend in (SdpaBackend(), FlexBackend(compile=False)):
        calls.clear()
        common = build_common_metadata(np.array([30, 30, 5]), is_causal=False)
        meta = backend.build_metadata(common)
        layers = [biased_layer(4, 4, 32, bias, 1.0) for _ in range(3)]
        q = torch.randn(65, 128)
        with torch.inference_mode(), set_forward_context(forward_context_for(layers, backend, meta)):
            outs = [layer(q, q, q) for layer in layers]
        assert len(calls) == 1, backend.name
        torch.testing.assert_close(outs[0], outs[2])


# ---------------------------------------------------------------------------------------------------------
# Compiled FlexAttention: a few cases by default, the matrix with --run-slow
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_kv_free_cross(device):
    check_cross("flex", device, "mixed", 8, 2, 64, torch.float32)


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_relative_bias_kv_free(device):
    check_bias("flex", device, True, 8, 2, 64, torch.float32, 1.0)


def _compile_once(device, cross: bool):
    """Paged cross steps, or biased decoder steps, of one query size class over one cache size compile
    once, whatever their sequences, block tables and bias tables."""
    from torch._dynamo.utils import counters

    backend, block_size = _backend("flex", device, torch.float32, 64, 8, 2, 16)
    if cross:
        mixes = (PAGED_CROSS_MIXES["some-write"], PAGED_CROSS_MIXES["read-only"])
        steps = [CrossStep(mix, 8, 2, 64, torch.float32, device, block_size) for mix in mixes]
        reference = CrossStep.kv_free
    else:
        mixes = (PAGED_BIAS_MIXES["mixed"], [(30, 1), (3, 1), (0, 9), (44, 12)])
        steps = [
            _biased_step(mix, 8, 2, 64, torch.float32, device, block_size, make_bias(8, True, device, seed=seed))
            for seed, mix in enumerate(mixes)
        ]
        reference = Step.full_causal
    graphs = None
    for step in steps:
        assert step.cache.shape[1] == 64
        with torch.inference_mode():
            torch.testing.assert_close(step.run(backend), reference(step), atol=2e-5, rtol=2e-5)
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_paged_bias_compiles_once(device):
    _compile_once(device, cross=False)


@pytest.mark.slow
@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_paged_cross_compiles_once(device):
    """The paged mask_mod is self-attention's (only each query's limit differs), so by default the
    compiled kernel is checked there (test_paged_backends.py) and cross-attention eagerly."""
    _compile_once(device, cross=True)


_COMPILED_MATRIX = [
    # dtype, block size, heads, kv heads
    (torch.float32, 12, 4, 4),
    (torch.bfloat16, 16, 8, 2),
    (torch.bfloat16, 48, 4, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
@pytest.mark.parametrize("dtype,block_size,heads,kv_heads", _COMPILED_MATRIX)
def test_compiled_flex_everywhere(device, dtype, block_size, heads, kv_heads):
    for mix in CROSS_MIXES:
        check_cross("flex", device, mix, heads, kv_heads, 64, dtype)
    for causal in (False, True):
        check_bias("flex", device, causal, heads, kv_heads, 64, dtype, 1.0)
    backend, _ = _backend("flex", device, dtype, 64, heads, kv_heads, block_size)
    for mix in PAGED_CROSS_MIXES.values():
        step = CrossStep(mix, heads, kv_heads, 64, dtype, device, block_size)
        torch.testing.assert_close(step.run(backend), step.kv_free(), **_tolerance(dtype))
    for mix in PAGED_BIAS_MIXES.values():
        step = _biased_step(mix, heads, kv_heads, 64, dtype, device, block_size, make_bias(heads, True, device))
        with torch.inference_mode():
            torch.testing.assert_close(step.run(backend), step.full_causal(), **_bias_tolerance(dtype))


# ---------------------------------------------------------------------------------------------------------
# Selection: the flash kernels cannot add a bias
# ---------------------------------------------------------------------------------------------------------

BIAS_REASON = "cannot add the relative position bias of T5 and MPNet; use sdpa, flex or naive"


def _spec(device, dtype=torch.bfloat16, relative_bias=True):
    return AttentionSpec(torch.device(device), dtype, 64, 8, 8, is_causal=False, relative_bias=relative_bias)


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_flash_kernels_are_refused_for_a_relative_bias(name, device):
    """The bias reason comes first: on CUDA where the kernel could otherwise run (no GPU is needed to ask),
    and on CPU where the device reason applies too."""
    reason = unsupported_reason(name, _spec(device))
    assert reason is not None and BIAS_REASON in reason
    with pytest.raises(ConfigError, match=f"--attention-backend {name} cannot run here: .*{BIAS_REASON}"):
        select_backend(name, _spec(device))


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
def test_flash_kernels_say_nothing_of_a_bias_without_one(name):
    reason = unsupported_reason(name, _spec("cpu", relative_bias=False))
    assert reason is not None and "bias" not in reason


def test_auto_selection_skips_the_flash_kernels_for_a_relative_bias():
    assert select_backend(None, _spec("cuda")).name == "sdpa"
    assert select_backend(None, _spec("cpu", torch.float32)).name == "sdpa"
    for name in ("sdpa", "flex", "naive"):
        assert unsupported_reason(name, _spec("cpu", torch.float32)) is None


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
def test_flash_kernels_raise_if_a_biased_layer_reaches_them(name):
    layer = biased_layer(4, 4, 32, make_bias(4, False, "cpu"), 1.0)
    with pytest.raises(NotImplementedError, match=BIAS_REASON):
        refuse_relative_bias(layer, name)
    refuse_relative_bias(Attention(4, 32), name)
    module = pytest.importorskip(f"embedserv.attention.backends.{name}")
    backend = next(c for c in vars(module).values() if isinstance(c, type) and getattr(c, "name", None) == name)()
    common = build_common_metadata(np.array([3]), is_causal=False)
    q = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=BIAS_REASON):
        backend.forward(layer, q, q, q, None, backend.build_metadata(common))
