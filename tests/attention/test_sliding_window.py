"""Sliding-window attention on every backend, KV-free (whole sequences and suffix queries) and paged.

A query at position p sees the key at position j only when |p - j| < W (and j <= p when causal); a
sequence's queries are the last len_q of its len_k positions. The naive oracle is checked against a dense
reference written from that definition; every other backend against the naive oracle. Eager
FlexAttention applies only the mask_mod, so the BlockMask (which blocks a compiled kernel visits, and
which it takes whole without the mask_mod) is checked on its own against the mask_mod, and a few shapes
run compiled.
"""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from embedserv.attention import selector
from embedserv.attention.backends.flex import FlexBackend, paged_block_mask
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, build_suffix_metadata, cumulative_offsets
from embedserv.attention.selector import AttentionSpec, select_backend, unsupported_reason
from embedserv.errors import ConfigError
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import COMPILED_FLEX_DEVICES, DEVICES, TOLERANCE
from tests.attention.test_cross_and_bias import _paged_backend
from tests.attention.test_paged_backends import Step, _backend
from tests.attention.test_relative_bias import biased_layer, make_bias
from tests.helpers.matrix import matrix

HEADS, KV_HEADS, HEAD_SIZE = 8, 2, 32
WINDOWS = [1, 3, 7, 16, 100]
# Whole sequences: longer and shorter than the windows, runs of one length, one long enough for the CPU
# bfloat16 matmul path.
LENGTHS = [70, 16, 3, 1, 9, 9, 40, 7]
# (len_q, len_k) per sequence: the prefill skip's one last token each, and any suffix (whole sequences
# among them, and a long one for the CPU bfloat16 matmul path).
SUFFIXES = {
    "last-token": [(1, n) for n in LENGTHS],
    "mixed": [(5, 70), (16, 16), (1, 3), (1, 1), (2, 9), (2, 9), (66, 70), (7, 7)],
}
# (tokens already cached, new tokens) per sequence.
PAGED_MIXES = {
    "prefills": [(0, 70), (0, 7), (0, 20)],
    "chunks": [(32, 20), (5, 60), (63, 1)],
    "decodes": [(10, 1), (33, 1), (0, 1), (47, 1), (69, 1)],
    "mixed": [(0, 7), (20, 1), (15, 9), (0, 1), (40, 1), (16, 16)],
}
# Backend and dtype: sdpa in bfloat16 too (its CPU matmul paths); the flash kernels run half precision.
BACKEND_DTYPES = [
    ("sdpa", torch.float32),
    ("sdpa", torch.bfloat16),
    ("flex-eager", torch.float32),
    ("varlen", torch.bfloat16),
    ("flash_attn", torch.bfloat16),
]
BACKEND_IDS = ["sdpa-fp32", "sdpa-bf16", "flex-eager-fp32", "varlen-bf16", "flash_attn-bf16"]


def _tolerance(dtype):
    return dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def dense_reference(q, k, v, lens_q, lens_k, causal, window, scale):
    """Per sequence: the whole score matrix in float64, the mask from the definition, softmax.
    q [num_q, H * D], k and v [num_k, KV * D] -> [num_q, H * D] float32 on CPU."""
    q, k, v = (x.double().cpu().view(x.shape[0], -1, HEAD_SIZE) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out, q_start, k_start = [], 0, 0
    for len_q, len_k in zip(lens_q, lens_k, strict=True):
        qs = q[q_start : q_start + len_q].transpose(0, 1)
        ks = k[k_start : k_start + len_k].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[k_start : k_start + len_k].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        p = np.arange(len_k - len_q, len_k)[:, None]
        j = np.arange(len_k)[None, :]
        seen = np.ones((len_q, len_k), dtype=bool)
        if causal:
            seen &= j <= p
        if window is not None:
            seen &= np.abs(p - j) < window
        scores[:, ~torch.from_numpy(seen)] = float("-inf")
        out.append((scores.softmax(dim=-1) @ vs).transpose(0, 1).reshape(len_q, -1))
        q_start, k_start = q_start + len_q, k_start + len_k
    return torch.cat(out).float()


def run_layers(backend, common, q, k, v, windows, kv_cache=None):
    """One layer per window, all over one metadata object (a step of windowed and full layers); each
    layer's output [num_q, H * D] as float32 on CPU."""
    meta = backend.build_metadata(common)
    layers = [Attention(HEADS, HEAD_SIZE, num_kv_heads=KV_HEADS, sliding_window=w) for w in windows]
    context = forward_context_for(layers, backend, meta, kv_caches=None if kv_cache is None else [kv_cache])
    with set_forward_context(context):
        return [layer(q, k, v).float().cpu() for layer in layers]


class KvFreeStep:
    """A KV-free step: each sequence's last len_q queries over its len_k keys (whole sequences when equal)."""

    def __init__(self, pairs, causal, dtype=torch.float32, device="cpu", seed=0):
        self.lens_q = np.array([p[0] for p in pairs])
        self.lens_k = np.array([p[1] for p in pairs])
        self.causal = causal
        gen = torch.Generator().manual_seed(seed)
        make = lambda n, heads: torch.randn(n, heads * HEAD_SIZE, generator=gen).to(device, dtype)  # noqa: E731
        self.q = make(int(self.lens_q.sum()), HEADS)
        self.k, self.v = make(int(self.lens_k.sum()), KV_HEADS), make(int(self.lens_k.sum()), KV_HEADS)
        cu_q, cu_k = (torch.from_numpy(cumulative_offsets(n)).to(device) for n in (self.lens_q, self.lens_k))
        if np.array_equal(self.lens_q, self.lens_k):
            self.common = build_common_metadata(self.lens_k, causal, cu_k)
        else:
            self.common = build_suffix_metadata(self.lens_q, self.lens_k, cu_q, cu_k, causal)

    def run(self, backend, windows):
        return run_layers(backend, self.common, self.q, self.k, self.v, windows)

    def reference(self, window):
        return dense_reference(self.q, self.k, self.v, self.lens_q, self.lens_k, self.causal, window, HEAD_SIZE**-0.5)


def paged_step(mix, dtype, device, block_size):
    return Step(mix, HEADS, KV_HEADS, HEAD_SIZE, dtype, device, block_size)


def run_paged(step, backend, windows):
    return run_layers(backend, step.common, step.q, step.k, step.v, windows, step.cache)


def paged_reference(step, window):
    keys, values = torch.cat(step.ks), torch.cat(step.vs)
    return dense_reference(step.q, keys, values, step.news, step.totals, True, window, HEAD_SIZE**-0.5)


# --- The oracle against the definition ---


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("pairs", [[(n, n) for n in LENGTHS], *SUFFIXES.values()], ids=["whole", *SUFFIXES])
def test_naive_kv_free_matches_the_definition(pairs, causal, window):
    step = KvFreeStep(pairs, causal)
    (out,) = step.run(NaiveBackend(), [window])
    torch.testing.assert_close(out, step.reference(window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mix", list(PAGED_MIXES))
def test_naive_paged_matches_the_definition(mix, window):
    step = paged_step(PAGED_MIXES[mix], torch.float32, "cpu", 16)
    (out,) = run_paged(step, NaiveBackend(), [window])
    torch.testing.assert_close(out, paged_reference(step, window), atol=1e-5, rtol=1e-5)


# --- Every backend against the oracle ---


def _make(name, device, dtype):
    """The backend (naive, flex compiled, flex-eager, ...), or a skip that says why it cannot run here."""
    return _backend(name, device, dtype, HEAD_SIZE, HEADS, KV_HEADS)[0]


@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES, ids=BACKEND_IDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", WINDOWS)
def test_kv_free_whole_sequences(name, dtype, device, causal, window):
    backend = _make(name, device, dtype)
    step = KvFreeStep([(n, n) for n in LENGTHS], causal, dtype, device)
    (out,), (expected,) = step.run(backend, [window]), step.run(NaiveBackend(), [window])
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


@matrix(
    "name,dtype,device,mix,causal,window",
    [BACKEND_DTYPES, DEVICES, list(SUFFIXES), [False, True], [None, *WINDOWS]],
    ids=[lambda b: BACKEND_IDS[BACKEND_DTYPES.index(b)], None, None, lambda c: "causal" if c else "bidirectional"],
    spread=(0,),
)
def test_kv_free_suffix_queries(name, dtype, device, mix, causal, window):
    backend = _make(name, device, dtype)
    step = KvFreeStep(SUFFIXES[mix], causal, dtype, device)
    (out,), (expected,) = step.run(backend, [window]), step.run(NaiveBackend(), [window])
    torch.testing.assert_close(out, expected, **_tolerance(dtype))


@matrix(
    "name,dtype,device,mix,block_size,window",
    [BACKEND_DTYPES, DEVICES, list(PAGED_MIXES), [(16, 1), (16, 3), (16, 7), (16, 16), (12, 3), (12, 16)]],
    ids=[lambda b: BACKEND_IDS[BACKEND_DTYPES.index(b)], None, None, lambda bw: f"block{bw[0]}-window{bw[1]}"],
    spread=(0, 3),
)
def test_paged(name, dtype, device, mix, block_size, window):
    backend, block_size = _paged_backend(name, device, dtype, HEAD_SIZE, HEADS, KV_HEADS, block_size)
    step = paged_step(PAGED_MIXES[mix], dtype, device, block_size)
    (out,) = run_paged(step, backend, [window])
    torch.testing.assert_close(out, paged_reference(step, window), **_tolerance(dtype))
    torch.testing.assert_close(out, run_paged(step, NaiveBackend(), [window])[0], **_tolerance(dtype))


# Windowed and full layers over one metadata object, a window repeated (its masks made once, reused).
MIXED_LAYERS = [None, 7, None, 3, 7, 100]


@pytest.mark.parametrize("name,dtype", BACKEND_DTYPES, ids=BACKEND_IDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["whole", "suffix", "paged"])
def test_windowed_and_full_layers_share_a_step(name, dtype, device, kind):
    if kind == "paged":
        backend, block_size = _paged_backend(name, device, dtype, HEAD_SIZE, HEADS, KV_HEADS, 16)
        step = paged_step(PAGED_MIXES["mixed"] + PAGED_MIXES["chunks"], dtype, device, block_size)
        outs = run_paged(step, backend, MIXED_LAYERS)
        expected = [run_paged(step, NaiveBackend(), [w])[0] for w in MIXED_LAYERS]
    else:
        backend = _make(name, device, dtype)
        pairs = [(n, n) for n in LENGTHS] if kind == "whole" else SUFFIXES["mixed"]
        step = KvFreeStep(pairs, True, dtype, device)
        outs = step.run(backend, MIXED_LAYERS)
        expected = [step.run(NaiveBackend(), [w])[0] for w in MIXED_LAYERS]
    for out, reference in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, reference, **_tolerance(dtype))


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
    assert select_backend(None, _spec()).name == "sdpa"
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
