"""The extend/decode case: queries shorter than keys, keys and values read from the paged KV cache.

Each sequence has `start` tokens already in the cache (written there beforehand, in blocks scattered over
the cache) and `new` tokens computed this step. The oracle is the naive backend over the whole sequence
without a cache (causal), whose last `new` rows the step must reproduce; every backend must also leave
the new keys and values in their slots.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.base import kv_cache_shape
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, build_paged_metadata, cumulative_offsets
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.worker.generation_inputs import token_slots
from tests.attention.test_backends import DEVICES, HEAD_IDS, HEADS, TOLERANCE, make_backend

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# (tokens already cached, new tokens) per sequence.
MIXES = {
    "decodes": [(10, 1), (33, 1), (0, 1), (47, 1)],
    "prefills": [(0, 7), (0, 40)],
    "mixed": [(0, 7), (20, 1), (15, 9), (0, 1), (40, 1), (16, 16)],
    "chunks": [(32, 20), (5, 60), (63, 1)],
}
BACKENDS = ["naive", "sdpa", "flex-eager", "varlen", "flash_attn"]


def _tensors(total_lens, heads, kv_heads, head_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda width: [torch.randn(n, width, generator=gen).to(device, dtype) for n in total_lens]  # noqa: E731
    return make(heads * head_size), make(kv_heads * head_size), make(kv_heads * head_size)


def _block_tables(total_lens, seed=0):
    """Distinct blocks for every sequence, in a shuffled order (tables are not contiguous)."""
    order = np.random.default_rng(seed).permutation(NUM_BLOCKS).tolist()
    tables = []
    for n in total_lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(order[:count])
        order = order[count:]
    return tables


def run_step(backend, mix, heads, kv_heads, head_size, dtype, device, unowned_fill: float = 0.0):
    """(the step's output [num_new, H*D], the oracle's, the cache, the new keys and their slots).

    Blocks no sequence owns hold `unowned_fill`."""
    starts = [s for s, _ in mix]
    news = [n for _, n in mix]
    totals = [s + n for s, n in mix]
    qs, ks, vs = _tensors(totals, heads, kv_heads, head_size, dtype, device)
    tables = _block_tables(totals)
    layer = Attention(heads, head_size, num_kv_heads=kv_heads)
    cache = torch.full(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_size), unowned_fill, dtype=dtype, device=device)
    cache[:, [b for table in tables for b in table]] = 0
    flat_k = cache[0].view(-1, kv_heads, head_size)
    flat_v = cache[1].view(-1, kv_heads, head_size)
    for table, start, k, v in zip(tables, starts, ks, vs):
        slots = torch.from_numpy(token_slots(table, 0, start, BLOCK_SIZE)).to(device)
        flat_k[slots] = k[:start].view(-1, kv_heads, head_size)
        flat_v[slots] = v[:start].view(-1, kv_heads, head_size)

    key_slots = [token_slots(table, 0, total, BLOCK_SIZE) for table, total in zip(tables, totals)]
    slot_mapping = np.concatenate([slots[start:] for slots, start in zip(key_slots, starts)])
    to = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731
    common = build_paged_metadata(
        np.array(news), np.array(totals), to(cumulative_offsets(np.array(news))), to(cumulative_offsets(np.array(totals))),
        to(slot_mapping), to(np.concatenate(key_slots)),
    )
    q = torch.cat([q[s:] for q, s in zip(qs, starts)])
    k = torch.cat([k[s:] for k, s in zip(ks, starts)])
    v = torch.cat([v[s:] for v, s in zip(vs, starts)])
    context = ForwardContext(attn_metadata=backend.build_metadata(common), attn_backend=backend, kv_caches=[cache])
    with set_forward_context(context):
        out = layer(q, k, v).float().cpu()

    oracle = NaiveBackend()
    expected = []
    for q_full, k_full, v_full, start, total in zip(qs, ks, vs, starts, totals):
        meta = oracle.build_metadata(build_common_metadata(np.array([total]), is_causal=True))
        with set_forward_context(ForwardContext(attn_metadata=meta, attn_backend=oracle)):
            expected.append(layer(q_full, k_full, v_full)[start:].float().cpu())
    return out, torch.cat(expected), cache, k, to(slot_mapping)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(MIXES), ids=list(MIXES))
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("head_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_step_matches_full_causal_attention(name, device, mix, heads, kv_heads, head_size, dtype):
    backend = NaiveBackend() if name == "naive" else make_backend(name, device, dtype, head_size, heads, kv_heads, True)
    out, expected, cache, new_keys, slot_mapping = run_step(backend, MIXES[mix], heads, kv_heads, head_size, dtype, device)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    written = cache[0].view(-1, kv_heads, head_size)[slot_mapping]
    torch.testing.assert_close(written, new_keys.view(-1, kv_heads, head_size), atol=0, rtol=0)


def test_a_decode_sees_only_its_own_blocks():
    """Values in blocks no sequence owns (including the padding slots of the decode batch) change nothing."""
    backend = make_backend("sdpa", "cpu", torch.float32, 32, 4, 4, True)
    clean, _, _, _, _ = run_step(backend, MIXES["mixed"], 4, 4, 32, torch.float32, "cpu")
    noisy, _, _, _, _ = run_step(backend, MIXES["mixed"], 4, 4, 32, torch.float32, "cpu", unowned_fill=1e4)
    torch.testing.assert_close(noisy, clean, atol=0, rtol=0)
