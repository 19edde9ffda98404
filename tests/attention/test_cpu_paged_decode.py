"""cpu_varlen's paged_decode: one query per sequence over the paged cache, read in place through its block table.

The op against a float64 reference over the same cache (head sizes 32 to 128 and 80, GQA, windows, block sizes
that are not powers of two, both dtypes), and a decode step through the backend that copies no key: the sdpa
path it replaces gathered every key of the step first (index_select), then read the copy again.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends import cpu_varlen_kernel
from embedserv.attention.backends.cpu_varlen import CpuVarlenBackend
from embedserv.attention.selector import AttentionSpec, unsupported_reason
from tests.attention.test_backends import TOLERANCE
from tests.attention.test_paged_backends import MIXES, Step

pytestmark = pytest.mark.skipif(
    unsupported_reason("cpu_varlen", AttentionSpec(torch.device("cpu"), torch.float32, 64, 4, 4, False)) is not None,
    reason="cpu_varlen cannot run here (no C++ compiler)",
)


def _reference(q, cache, tables, positions, window, scale):
    """float64, key by key: the query at position p sees keys j <= p with p - j < window."""
    n, heads, size = q.shape
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    out = torch.empty(n, heads, size, dtype=torch.float64)
    for i in range(n):
        p = int(positions[i])
        keys = range(max(0, p - window + 1) if window else 0, p + 1)
        slots = [(int(tables[i, j // block_size]), j % block_size) for j in keys]
        k = torch.stack([cache[0, b, s] for b, s in slots]).double()  # [L, kv_heads, d]
        v = torch.stack([cache[1, b, s] for b, s in slots]).double()
        for h in range(heads):
            kv = h // (heads // kv_heads)
            probs = (k[:, kv] @ q[i, h].double() * scale).softmax(0)
            out[i, h] = probs @ v[:, kv]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (12, 12)], ids=["mha", "gqa", "minilm"])
@pytest.mark.parametrize("head_size", [32, 64, 80, 128])
@pytest.mark.parametrize("window", [0, 1, 20])
@pytest.mark.parametrize("block_size", [16, 12])
def test_paged_decode_equals_attention_over_the_cache(dtype, heads, kv_heads, head_size, window, block_size):
    op = cpu_varlen_kernel.paged_decode_op()
    gen = torch.Generator().manual_seed(head_size + heads + window)
    lens = [1, 17, 40, 3, 64, 29]  # keys per decode, the query's own included
    tables = torch.from_numpy(np.random.default_rng(0).permutation(64)[: 6 * 6].reshape(6, 6)).to(torch.int32)
    cache = torch.randn(2, 64, block_size, kv_heads, head_size, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_size, generator=gen).to(dtype)
    positions = torch.tensor(lens) - 1
    scale = head_size**-0.5
    out = op(q, cache, tables, positions, window, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, cache, tables, positions, window, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_decode_step_reads_the_cache_in_place():
    """Decodes of mixed lengths through the backend: the oracle's answer, one paged_decode call per layer, and
    no gathered copy of the keys (sdpa's decode path index_selects every block of the step)."""
    step = Step(MIXES["decodes"], 8, 2, 64, torch.float32, "cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = step.run(CpuVarlenBackend())
    torch.testing.assert_close(out, step.full_causal(), atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    calls = {event.key: event.count for event in prof.key_averages()}
    assert calls.get("embedserv_cpu_varlen::paged_decode") == 1
    assert "aten::index_select" not in calls and "aten::embedding_bag" not in calls, sorted(calls)
