"""Every attention backend computes the function the naive oracle does, on random packed batches."""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend, plan_runs
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata
from embedserv.forward_context import ForwardContext, set_forward_context

BACKENDS = [SdpaBackend]
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
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _run(backend, lens, heads, kv_heads, head_size, causal, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, heads * head_size, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads * head_size, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads * head_size, generator=gen).to(dtype)
    layer = Attention(heads, head_size, num_kv_heads=kv_heads)
    common = build_common_metadata(np.array(lens), is_causal=causal)
    context = ForwardContext(attn_metadata=backend.build_metadata(common), attn_backend=backend)
    with set_forward_context(context):
        return layer(q, k, v).float()


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("lens", LENGTH_MIXES, ids=lambda l: f"{len(l)}seqs")
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_naive(backend_cls, lens, causal, heads, kv_heads, head_size, dtype):
    expected = _run(NaiveBackend(), lens, heads, kv_heads, head_size, causal, dtype)
    actual = _run(backend_cls(), lens, heads, kv_heads, head_size, causal, dtype)
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_causal_differs_from_bidirectional():
    lens = [6, 3]
    a = _run(SdpaBackend(), lens, 2, 2, 32, False, torch.float32)
    b = _run(SdpaBackend(), lens, 2, 2, 32, True, torch.float32)
    # The last token of each sequence sees everything either way; earlier ones do not.
    assert not torch.allclose(a[0], b[0])
    torch.testing.assert_close(a[5], b[5])


def test_sequences_do_not_attend_across_the_pack():
    lens = [4, 9]
    packed = _run(SdpaBackend(), lens, 2, 2, 32, False, torch.float32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(13, 64, generator=gen)
    k = torch.randn(13, 64, generator=gen)
    v = torch.randn(13, 64, generator=gen)
    layer = Attention(2, 32)
    backend = SdpaBackend()
    for start, n in ((0, 4), (4, 9)):
        meta = backend.build_metadata(build_common_metadata(np.array([n]), is_causal=False))
        with set_forward_context(ForwardContext(attn_metadata=meta, attn_backend=backend)):
            alone = layer(q[start : start + n], k[start : start + n], v[start : start + n])
        torch.testing.assert_close(packed[start : start + n], alone, atol=1e-5, rtol=1e-5)


def test_runs_split_where_length_changes():
    runs = plan_runs(np.array([5, 5, 3, 3, 3, 5, 1]))
    assert [(r.token_start, r.num_seqs, r.length) for r in runs] == [(0, 2, 5), (10, 3, 3), (19, 1, 5), (24, 1, 1)]
    assert plan_runs(np.array([], dtype=np.int64)) == ()
