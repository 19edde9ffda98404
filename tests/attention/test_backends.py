"""Every attention backend computes the function the naive oracle does, on random packed batches.

Backends that cannot run on a device (CUDA-only kernels on CPU, flash-attn not installed) skip with the
selector's reason; on a GPU machine the same tests run on CUDA.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.flex import FlexBackend
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend, plan_runs
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata
from embedserv.attention.selector import AttentionSpec, backend_class, unsupported_reason
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.helpers.matrix import matrix

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# flex-eager: FlexAttention uncompiled, the same mask logic without a compile per shape (fast to test).
BACKENDS = ["sdpa", "cpu_varlen", "flex-eager", "varlen", "flash_attn"]
# Lengths chosen to exercise: single tokens, equal lengths, one long among short, many buckets.
LENGTH_MIXES = [
    [1],
    [7],
    [5, 5, 5],
    [1, 1, 2],
    [3, 200, 17, 1, 64, 65, 90],
    [300, 1, 2, 150, 149, 40, 41, 100, 75, 33],
    # Long runs of equal lengths: the CPU bfloat16 path cuts these into chunks.
    [256, 256, 256, 130, 130, 130, 130, 130, 1],
]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
HEADS = [(4, 4), (8, 2)]
HEAD_IDS = ["mha", "gqa"]


def make_backend(name: str, device: str, dtype, head_size: int, heads: int, kv_heads: int, causal: bool):
    """The backend, or a skip that says why it cannot run here."""
    base = name.removesuffix("-eager")
    spec = AttentionSpec(torch.device(device), dtype, head_size, heads, kv_heads, causal)
    reason = unsupported_reason(base, spec)
    if reason is not None:
        pytest.skip(reason)
    if name == "flex-eager":
        return FlexBackend(compile=False)
    return backend_class(base)()


def attend(backend, lens, heads, kv_heads, head_size, causal, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, heads * head_size, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, kv_heads * head_size, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, kv_heads * head_size, generator=gen).to(device, dtype)
    layer = Attention(heads, head_size, num_kv_heads=kv_heads)
    cu = torch.from_numpy(np.concatenate(([0], np.cumsum(lens)))).to(device)
    common = build_common_metadata(np.array(lens), is_causal=causal, cu_seqlens=cu)
    context = forward_context_for([layer], backend, backend.build_metadata(common))
    with set_forward_context(context):
        return layer(q, k, v).float().cpu()


def check_against_naive(name, device, lens, causal, heads, kv_heads, head_size, dtype):
    backend = make_backend(name, device, dtype, head_size, heads, kv_heads, causal)
    expected = attend(NaiveBackend(), lens, heads, kv_heads, head_size, causal, dtype, device)
    actual = attend(backend, lens, heads, kv_heads, head_size, causal, dtype, device)
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def every_shape(test):
    """Parametrizes a test over the whole matrix: devices, length mixes, causality, GQA, head sizes, dtypes."""
    marks = [
        pytest.mark.parametrize("device", DEVICES),
        pytest.mark.parametrize("lens", LENGTH_MIXES, ids=lambda lens: f"{len(lens)}seqs"),
        pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"]),
        pytest.mark.parametrize("heads,kv_heads", HEADS, ids=HEAD_IDS),
        pytest.mark.parametrize("head_size", [32, 64, 128]),
        pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]),
    ]
    for mark in reversed(marks):
        test = mark(test)
    return test


# The whole matrix runs with --run-slow; the default run, its pairwise cover (tests/helpers/matrix.py).
@matrix(
    "name,device,lens,causal,heads,kv_heads,head_size,dtype",
    [BACKENDS, DEVICES, LENGTH_MIXES, [False, True], HEADS, [32, 64, 128], [torch.float32, torch.bfloat16]],
    ids=[None, None, lambda lens: f"{len(lens)}seqs", lambda c: "causal" if c else "bidirectional",
         lambda h: HEAD_IDS[HEADS.index(h)]],
    spread=(4,),
)  # fmt: skip
def test_backend_matches_naive(name, device, lens, causal, heads, kv_heads, head_size, dtype):
    check_against_naive(name, device, lens, causal, heads, kv_heads, head_size, dtype)


# Compiled FlexAttention costs seconds per new (dtype, head size, heads, padded size) combination, so
# the default run compiles a few; --run-slow compiles the whole matrix.
_FLEX_FAST = [
    # dtype, head size, heads, kv heads, lengths (two size classes), causal
    (torch.float32, 64, 4, 4, LENGTH_MIXES[4], False),
    (torch.float32, 64, 4, 4, [30, 20, 1], True),
    (torch.bfloat16, 64, 8, 2, [30, 20, 1], False),
    (torch.bfloat16, 64, 8, 2, LENGTH_MIXES[4], True),
]


# CPU serves with sdpa, and compiling flex there costs seconds a case: the default run compiles one case on
# CPU (the first below) and every case on CUDA; the other compiled-flex tests run on CPU with --run-slow.
COMPILED_FLEX_DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), *DEVICES[1:]]


def _compiled_flex_cases():
    for device in DEVICES:
        for index, case in enumerate(_FLEX_FAST):
            yield pytest.param(device, *case, marks=pytest.mark.slow if device == "cpu" and index else ())


@pytest.mark.parametrize("device,dtype,head_size,heads,kv_heads,lens,causal", list(_compiled_flex_cases()))
def test_compiled_flex_matches_naive(device, dtype, head_size, heads, kv_heads, lens, causal):
    check_against_naive("flex", device, lens, causal, heads, kv_heads, head_size, dtype)


@pytest.mark.slow
@every_shape
def test_compiled_flex_matches_naive_everywhere(device, lens, causal, heads, kv_heads, head_size, dtype):
    check_against_naive("flex", device, lens, causal, heads, kv_heads, head_size, dtype)


def test_causal_differs_from_bidirectional():
    lens = [6, 3]
    a = attend(SdpaBackend(), lens, 2, 2, 32, False, torch.float32)
    b = attend(SdpaBackend(), lens, 2, 2, 32, True, torch.float32)
    # The last token of each sequence sees everything either way; earlier ones do not.
    assert not torch.allclose(a[0], b[0])
    torch.testing.assert_close(a[5], b[5])


@pytest.mark.parametrize("backend", [NaiveBackend(), SdpaBackend(), FlexBackend(compile=False)], ids=lambda b: b.name)
def test_sequences_do_not_attend_across_the_pack(backend):
    lens = [4, 9]
    packed = attend(backend, lens, 2, 2, 32, False, torch.float32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(13, 64, generator=gen)
    k = torch.randn(13, 64, generator=gen)
    v = torch.randn(13, 64, generator=gen)
    layer = Attention(2, 32)
    for start, n in ((0, 4), (4, 9)):
        meta = backend.build_metadata(build_common_metadata(np.array([n]), is_causal=False))
        with set_forward_context(forward_context_for([layer], backend, meta)):
            alone = layer(q[start : start + n], k[start : start + n], v[start : start + n])
        torch.testing.assert_close(packed[start : start + n], alone, atol=1e-5, rtol=1e-5)


def test_runs_split_where_length_changes():
    runs = plan_runs(np.array([5, 5, 3, 3, 3, 5, 1]))
    assert [(r.token_start, r.num_seqs, r.length) for r in runs] == [(0, 2, 5), (10, 3, 3), (19, 1, 5), (24, 1, 1)]
    assert plan_runs(np.array([], dtype=np.int64)) == ()


@pytest.mark.slow
def test_compiled_flex_stays_compiled_past_eight_kernels(caplog):
    """torch stops compiling a function after 8 entries and silently runs eager FlexAttention (100-1000x
    slower); a server compiles one entry per size class, dtype and head shape, so flex must raise the limit."""
    combos = [
        (dtype, head_size, causal)
        for dtype in (torch.float32, torch.bfloat16)
        for head_size in (16, 32, 64)
        for causal in (False, True)
    ]
    with caplog.at_level("WARNING"):
        for dtype, head_size, causal in combos:
            attend(FlexBackend(), [40, 30], 2, 2, head_size, causal, dtype)
    assert not [
        r for r in caplog.records if "recompile_limit" in r.getMessage() or "cache_size_limit" in r.getMessage()
    ]
