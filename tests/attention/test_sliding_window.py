"""Sliding-window attention on every backend, KV-free (whole sequences and suffix queries) and paged.

A query at position p sees the key at position j only when |p - j| < W (and j <= p when causal); a
sequence's queries are the last len_q of its len_k positions. The naive oracle is checked against a dense
reference written from that definition; every other backend against the naive oracle. Eager
FlexAttention applies only the mask_mod: its BlockMask and a few compiled shapes are checked in
test_sliding_window_flex.py.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, build_suffix_metadata, cumulative_offsets
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import DEVICES, TOLERANCE
from tests.attention.test_cross_and_bias import _paged_backend
from tests.attention.test_paged_backends import Step, _backend
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
    ("cpu_varlen", torch.float32),
    ("cpu_varlen", torch.bfloat16),
    ("flex-eager", torch.float32),
    ("varlen", torch.bfloat16),
    ("flash_attn", torch.bfloat16),
]
BACKEND_IDS = [
    "sdpa-fp32",
    "sdpa-bf16",
    "cpu_varlen-fp32",
    "cpu_varlen-bf16",
    "flex-eager-fp32",
    "varlen-bf16",
    "flash_attn-bf16",
]


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
