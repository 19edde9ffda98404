"""Sliding windows in FlexAttention's BlockMask (which blocks a compiled kernel visits, and which it takes whole
without the mask_mod), checked on its own against the mask_mod, and a few shapes run compiled against the naive
oracle (the steps and references of test_sliding_window.py).
"""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from embedserv.attention import selector
from embedserv.attention.backends.flex import FlexBackend
from embedserv.attention.backends.flex_paged import paged_block_mask
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata
from embedserv.attention.selector import AttentionSpec, select_backend, unsupported_reason
from embedserv.errors import ConfigError
from tests.attention.test_backends import COMPILED_FLEX_DEVICES
from tests.attention.test_paged_backends import _backend
from tests.attention.test_relative_bias import biased_layer, make_bias
from tests.attention.test_sliding_window import (
    HEAD_SIZE,
    HEADS,
    KV_HEADS,
    SUFFIXES,
    KvFreeStep,
    _make,
    _tolerance,
    paged_reference,
    paged_step,
    run_paged,
)
from tests.helpers.attention_default import cpu_default

# --- FlexAttention's BlockMask: what the compiled kernel visits ---


def _listed(num_blocks, indices, nk):
    """[nq, nk] bool from a BlockMask's per-query-block counts and indices."""
    counts, indices = num_blocks[0, 0], indices[0, 0].long()
    listed = torch.zeros(counts.shape[0], nk, dtype=torch.bool)
    for row, (count, index) in enumerate(zip(counts.tolist(), indices, strict=True)):
        listed[row, index[:count]] = True
    return listed


def assert_block_mask_is_exact(block_mask, num_queries):
    """Every block with a pair the mask_mod lets through is visited, and every block visited whole (no
    mask_mod) has every pair let through, for the real query rows (padding rows are discarded)."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    dense = create_mask(block_mask.mask_mod, 1, 1, q_len, kv_len, "cpu")[0, 0]
    dense[num_queries:] = False
    nq, nk = -(-q_len // q_block), -(-kv_len // kv_block)
    padded = torch.zeros(nq * q_block, nk * kv_block, dtype=torch.bool)
    padded[:q_len, :kv_len] = dense
    blocks = padded.view(nq, q_block, nk, kv_block)
    partial = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, nk)
    full = _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    assert not (partial & full).any()
    assert (partial | full)[blocks.any(dim=3).any(dim=1)].all(), "a block with visible keys is skipped"
    real_rows = torch.arange(nq * q_block).view(nq, q_block) < num_queries
    whole = (blocks | ~real_rows[:, :, None, None]).all(dim=3).all(dim=1)
    assert whole[full].all(), "a block taken whole hides a key"
    return partial | full


@pytest.mark.parametrize("window", [None, 1, 7, 100, 130, 300])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "pairs",
    [[(n, n) for n in (300, 200, 5, 30, 1)], [(1, 300), (40, 200), (30, 30), (1, 1), (150, 150)]],
    ids=["whole", "suffix"],
)
def test_flex_kv_free_block_mask_is_exact(pairs, causal, window):
    step = KvFreeStep(pairs, causal)
    meta = FlexBackend().build_metadata(step.common)
    visited = assert_block_mask_is_exact(meta.block_mask(window), int(step.lens_q.sum()))
    if window is not None and window <= 7:
        assert visited.sum() < assert_block_mask_is_exact(meta.block_mask(None), int(step.lens_q.sum())).sum()


@pytest.mark.parametrize("window", [None, 1, 7, 20, 100])
@pytest.mark.parametrize("block_size", [16, 12])
def test_flex_paged_block_mask_is_exact(block_size, window):
    step = paged_step([(300, 200), (0, 150), (40, 1), (130, 1), (5, 60)], torch.float32, "cpu", block_size)
    plan = FlexBackend().build_metadata(step.common).paged
    block_mask, _ = paged_block_mask(plan, step.common, step.cache.shape[1], window)
    visited = assert_block_mask_is_exact(block_mask, sum(step.news))
    if window is not None and window <= 20:
        unwindowed, _ = paged_block_mask(plan, step.common, step.cache.shape[1])
        assert visited.sum() < assert_block_mask_is_exact(unwindowed, sum(step.news)).sum()


# Compiled FlexAttention: seconds per new shape, so a few (the BlockMask tests above cover the rest):
# full blocks (windows longer than a 128-row block), several query blocks of one sequence, suffix
# queries, paged at two block sizes; --run-slow adds bidirectional and bfloat16 ones.
_COMPILED = {
    "whole-causal": ([(n, n) for n in (300, 70, 5, 1, 16)], True),
    "whole-bidirectional": ([(n, n) for n in (300, 70, 5, 1, 16)], False),
    "suffix-causal": ([(1, 300), (40, 200), (30, 30), (1, 1)], True),
}
_LONG_MIX = [(300, 200), (0, 150), (40, 1), (130, 1)]


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
@pytest.mark.parametrize(
    "kind", ["whole-causal", pytest.param("whole-bidirectional", marks=pytest.mark.slow), "suffix-causal"]
)
def test_compiled_flex_kv_free(device, kind):
    backend = _make("flex", device, torch.float32)
    step = KvFreeStep(*_COMPILED[kind], device=device)
    windows = [7, 130, 1]
    for out, window in zip(step.run(backend, windows), windows, strict=True):
        torch.testing.assert_close(out, step.reference(window), **_tolerance(torch.float32))


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
@pytest.mark.parametrize(
    "block_size,dtype",
    [(16, torch.float32), pytest.param(12, torch.bfloat16, marks=pytest.mark.slow)],
    ids=["16-fp32", "12-bf16"],
)
def test_compiled_flex_paged(device, block_size, dtype):
    backend, _ = _backend("flex", device, dtype, HEAD_SIZE, HEADS, KV_HEADS, block_size)
    step = paged_step(_LONG_MIX, dtype, device, block_size)
    windows = [7, 100]
    for out, window in zip(run_paged(step, backend, windows), windows, strict=True):
        torch.testing.assert_close(out, paged_reference(step, window), **_tolerance(dtype))


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_is_not_recompiled_for_another_window(device):
    """The window is an input of the compiled kernel: new values and new batches of one size class reuse
    the windowed layers' kernel (torch stops compiling after a few entries)."""
    from torch._dynamo.utils import counters

    backend = _make("flex", device, torch.float32)
    KvFreeStep([(40, 40), (30, 30)], True, device=device).run(backend, [5])
    graphs = counters["stats"]["unique_graphs"]
    for window, lengths in ((3, [50, 20, 1]), (16, [30, 30, 30]), (60, [70, 30])):
        step = KvFreeStep([(n, n) for n in lengths], True, device=device)
        torch.testing.assert_close(step.run(backend, [window])[0], step.reference(window), atol=2e-5, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == graphs


# --- Selection and refusals ---


def _spec(device="cpu", dtype=torch.float32, sliding_window=True, relative_bias=False):
    return AttentionSpec(
        torch.device(device),
        dtype,
        64,
        8,
        2,
        is_causal=True,
        relative_bias=relative_bias,
        sliding_window=sliding_window,
    )


def test_cpu_backends_run_a_window():
    for name in ("sdpa", "flex", "naive"):
        assert unsupported_reason(name, _spec()) is None
    assert select_backend(None, _spec()).name == cpu_default(_spec())
    # flash-attn (>= 2.6, the `flash` extra) always takes window_size: no window reason.
    assert "window" not in (unsupported_reason("flash_attn", _spec("cuda", torch.bfloat16)) or "")


def test_varlen_without_window_size_is_refused_for_a_window(monkeypatch):
    """Checked before the device: the same on a GPU machine as here."""
    monkeypatch.setattr(selector, "_varlen_takes_window", lambda: False)
    reason = unsupported_reason("varlen", _spec("cuda", torch.bfloat16))
    assert "cannot run a sliding window" in reason
    with pytest.raises(ConfigError, match="--attention-backend varlen cannot run here: .*sliding window"):
        select_backend("varlen", _spec("cuda", torch.bfloat16))
    assert "window" not in unsupported_reason("varlen", _spec(sliding_window=False))
    monkeypatch.setattr(selector, "_varlen_takes_window", lambda: True)
    assert "window" not in unsupported_reason("varlen", _spec())


def test_a_relative_bias_with_a_window_is_refused_everywhere():
    for name in selector._REGISTRY:
        assert "does not combine with a sliding window" in unsupported_reason(name, _spec(relative_bias=True))
    with pytest.raises(ConfigError, match="no attention backend runs here"):
        select_backend(None, _spec(relative_bias=True))


@pytest.mark.parametrize("backend", [SdpaBackend(), FlexBackend(compile=False)], ids=["sdpa", "flex"])
def test_a_biased_windowed_layer_raises(backend):
    layer = biased_layer(4, 4, 32, make_bias(4, False, "cpu"), 1.0)
    layer.sliding_window = 3
    q = torch.randn(10, 4, 32)
    meta = backend.build_metadata(build_common_metadata(np.array([6, 4]), is_causal=False))
    with pytest.raises(NotImplementedError, match="sliding window"):
        backend.forward(layer, q, q[:, :4], q[:, :4], None, meta)


@pytest.mark.parametrize("backend", [SdpaBackend(), FlexBackend(compile=False)], ids=["sdpa", "flex"])
def test_a_biased_layer_over_suffix_queries_raises(backend):
    """The prefill skip serves decoder models that share KV; T5 shares none."""
    layer = biased_layer(4, 4, 32, make_bias(4, True, "cpu"), 1.0)
    step = KvFreeStep(SUFFIXES["mixed"], True)
    q = torch.randn(int(step.lens_q.sum()), 4, 32)
    k = torch.randn(int(step.lens_k.sum()), 4, 32)
    with pytest.raises(NotImplementedError, match="suffix queries"):
        backend.forward(layer, q, k, k, None, backend.build_metadata(step.common))


def test_varlen_without_window_size_raises_for_a_windowed_layer(monkeypatch):
    varlen = pytest.importorskip("embedserv.attention.backends.varlen")
    monkeypatch.setattr(varlen, "TAKES_WINDOW", False)
    layer = Attention(4, 32, sliding_window=3)
    q = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    backend = varlen.VarlenBackend()
    with pytest.raises(NotImplementedError, match="cannot run a sliding window"):
        backend.forward(layer, q, q, q, None, backend.build_metadata(build_common_metadata(np.array([3]), True)))
