"""Cross-attention on every backend, against the naive oracle (T5's relative position bias:
test_relative_bias.py).

Cross-attention: decoder queries over the encoder keys of their own sequence, len_q and len_k unrelated.
KV-free (prefill-only work: monoT5 scores one decoder token per document, BART classifies with as many
decoder tokens as encoder ones) the keys are packed apart from the queries; paged (generation) a step
writes the encoder keys of the sequences whose encoder runs in it and reads every key from the cache
through the cross block tables.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.base import kv_cache_shape
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention, AttentionKind
from embedserv.attention.metadata import (
    build_cross_metadata,
    build_paged_metadata,
    cumulative_offsets,
)
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import DEVICES, TOLERANCE, make_backend
from tests.attention.test_paged_backends import _backend, _block_tables, _padded, _slots

BACKENDS = ["sdpa", "cpu_varlen", "flex-eager", "varlen", "flash_attn"]
# The flash kernels run half precision only: where a test has one dtype, theirs is bfloat16.
EXACT = ("naive", "sdpa", "cpu_varlen", "flex-eager", "flex")


def _dtype_for(name):
    return torch.float32 if name in EXACT else torch.bfloat16


def _tolerance(dtype):
    return dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _to(a, device):
    return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)


# ---------------------------------------------------------------------------------------------------------
# KV-free cross-attention
# ---------------------------------------------------------------------------------------------------------

# (len_q, len_k) per sequence.
CROSS_MIXES = {
    # monoT5: one decoder token per document, documents of every length.
    "monot5": [(1, 200), (1, 130), (1, 37), (1, 5), (1, 5), (1, 1)],
    # BART classification: the decoder input is the encoder's, shifted.
    "classify": [(40, 40), (40, 40), (17, 17), (1, 1)],
    # Anything: longer and shorter queries than keys, runs of one query length over different key lengths.
    "mixed": [(3, 50), (60, 7), (9, 9), (9, 30), (9, 30), (1, 1), (1, 20), (150, 3)],
}


def attend_cross(backend, pairs, heads, kv_heads, head_size, dtype, device="cpu", seed=0):
    """One KV-free cross layer over packed decoder queries and packed encoder keys -> [num_q, H*D] fp32 CPU."""
    lens_q, lens_k = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(int(lens_q.sum()), heads * head_size, generator=gen).to(device, dtype)
    k = torch.randn(int(lens_k.sum()), kv_heads * head_size, generator=gen).to(device, dtype)
    v = torch.randn(int(lens_k.sum()), kv_heads * head_size, generator=gen).to(device, dtype)
    layer = Attention(heads, head_size, num_kv_heads=kv_heads, kind=AttentionKind.CROSS)
    common = build_cross_metadata(
        lens_q, lens_k, _to(cumulative_offsets(lens_q), device), _to(cumulative_offsets(lens_k), device)
    )
    meta = backend.build_metadata(common)
    # A KV-free step's cross layers read the context's cross metadata; the self-attention one is unused.
    context = forward_context_for([layer], backend, meta, cross_metadata=meta)
    with set_forward_context(context):
        return layer(q, k, v).float().cpu()


def check_cross(name, device, mix, heads, kv_heads, head_size, dtype):
    backend = make_backend(name, device, dtype, head_size, heads, kv_heads, False)
    pairs = CROSS_MIXES[mix]
    expected = attend_cross(NaiveBackend(), pairs, heads, kv_heads, head_size, dtype, device)
    actual = attend_cross(backend, pairs, heads, kv_heads, head_size, dtype, device)
    torch.testing.assert_close(actual, expected, **_tolerance(dtype))


# (heads, kv heads, dtype): grouped-query attention in both dtypes, plain attention once.
HEADS_DTYPES = [(8, 2, torch.float32), (8, 2, torch.bfloat16), (4, 4, torch.float32)]
HEADS_DTYPE_IDS = ["gqa-fp32", "gqa-bf16", "mha-fp32"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(CROSS_MIXES))
@pytest.mark.parametrize("heads,kv_heads,dtype", HEADS_DTYPES, ids=HEADS_DTYPE_IDS)
def test_kv_free_cross_matches_naive(name, device, mix, heads, kv_heads, dtype):
    check_cross(name, device, mix, heads, kv_heads, 64, dtype)


# ---------------------------------------------------------------------------------------------------------
# Paged cross-attention
# ---------------------------------------------------------------------------------------------------------

# (decoder queries this step, encoder length, whether the encoder runs this step and writes its keys).
PAGED_CROSS_MIXES = {
    # Every key already in the cache: k = v = None, nothing written.
    "read-only": [(1, 37, False), (1, 5, False), (1, 70, False), (4, 16, False), (1, 1, False), (20, 9, False)],
    # First steps among later ones: some write their encoder keys, every key is then read from the cache.
    "some-write": [(1, 37, True), (1, 5, False), (3, 70, True), (1, 16, False), (20, 9, False), (1, 24, True)],
    # Every sequence starts: decoder prompts longer and shorter than their encoder input.
    "all-write": [(5, 30, True), (30, 5, True), (1, 1, True), (1, 40, True)],
}


class CrossStep:
    """One paged cross step: the cross cache (keys of read-only sequences written beforehand, garbage in
    the slots this step writes), this step's decoder queries and encoder keys, and the metadata."""

    def __init__(self, mix, heads, kv_heads, head_size, dtype, device, block_size, unowned_fill=0.0, seed=0):
        self.lens_q = np.array([m[0] for m in mix])
        self.lens_k = np.array([m[1] for m in mix])
        self.writes = [m[2] for m in mix]
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(int(self.lens_q.sum()), heads * head_size, generator=gen).to(device, dtype)
        self.k_all = torch.randn(int(self.lens_k.sum()), kv_heads * head_size, generator=gen).to(device, dtype)
        self.v_all = torch.randn(int(self.lens_k.sum()), kv_heads * head_size, generator=gen).to(device, dtype)
        needed = sum(-(-int(n) // block_size) for n in self.lens_k)
        num_blocks = max(64, 2 * needed)
        self.tables = _block_tables(self.lens_k.tolist(), block_size, num_blocks, seed=seed + 1)
        self.cache = torch.full(
            kv_cache_shape(num_blocks, block_size, kv_heads, head_size), unowned_fill, dtype=dtype, device=device
        )
        flat_k = self.cache[0].view(-1, kv_heads, head_size)
        flat_v = self.cache[1].view(-1, kv_heads, head_size)
        starts = cumulative_offsets(self.lens_k)
        written, slot_mapping = [], []
        for table, start, length, writes in zip(self.tables, starts[:-1], self.lens_k, self.writes, strict=True):
            slots = _to(_slots(table, 0, int(length), block_size), device)
            rows = slice(int(start), int(start) + int(length))
            if writes:
                # What the step must overwrite before it reads.
                flat_k[slots] = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(device, dtype) * 50
                flat_v[slots] = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(device, dtype) * 50
                written.append(rows)
                slot_mapping.append(slots)
            else:
                flat_k[slots] = self.k_all[rows].view(-1, kv_heads, head_size)
                flat_v[slots] = self.v_all[rows].view(-1, kv_heads, head_size)
        self.k = torch.cat([self.k_all[r] for r in written]) if written else None
        self.v = torch.cat([self.v_all[r] for r in written]) if written else None
        no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        self.slot_mapping = torch.cat(slot_mapping) if slot_mapping else no_slots
        self.common = build_paged_metadata(
            self.lens_q,
            self.lens_k,
            _to(cumulative_offsets(self.lens_q), device),
            _to(cumulative_offsets(self.lens_k), device),
            self.slot_mapping,
            torch.from_numpy(_padded(self.tables)).to(device),
            _to(self.lens_k, device),
            block_size,
            cross=True,
        )
        self.layer = Attention(heads, head_size, num_kv_heads=kv_heads, kind=AttentionKind.CROSS)
        self.device = device

    def run(self, backend) -> torch.Tensor:
        context = forward_context_for(
            [self.layer], backend, backend.build_metadata(self.common), kv_caches=[self.cache]
        )
        with set_forward_context(context):
            return self.layer(self.q, self.k, self.v).float().cpu()

    def kv_free(self) -> torch.Tensor:
        """The naive oracle without a cache: every sequence's queries over its packed encoder keys."""
        oracle = NaiveBackend()
        common = build_cross_metadata(
            self.lens_q,
            self.lens_k,
            _to(cumulative_offsets(self.lens_q), self.device),
            _to(cumulative_offsets(self.lens_k), self.device),
        )
        meta = oracle.build_metadata(common)
        with set_forward_context(forward_context_for([self.layer], oracle, meta, cross_metadata=meta)):
            return self.layer(self.q, self.k_all, self.v_all).float().cpu()


def _paged_backend(name, device, dtype, head_size, heads, kv_heads, block_size):
    """(backend, block size): `block_size` where the backend reads it; where it cannot (the flash kernels
    read pages of 256) its own default instead of 16, and a skip instead of any other size."""
    backend, default = _backend(name, device, dtype, head_size, heads, kv_heads)
    try:
        backend.check_block_size(block_size, torch.device(device))
    except ValueError as error:
        if block_size != 16:
            pytest.skip(str(error))
        return backend, default
    return backend, block_size


@pytest.mark.parametrize("name", ["naive", *BACKENDS])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(PAGED_CROSS_MIXES))
@pytest.mark.parametrize("block_size,dtype", [(16, torch.float32), (12, torch.bfloat16)], ids=["16-fp32", "12-bf16"])
def test_paged_cross_matches_kv_free(name, device, mix, block_size, dtype):
    backend, block_size = _paged_backend(name, device, dtype, 64, 8, 2, block_size)
    step = CrossStep(PAGED_CROSS_MIXES[mix], 8, 2, 64, dtype, device, block_size)
    out = step.run(backend)
    torch.testing.assert_close(out, step.kv_free(), **_tolerance(dtype))
    if step.k is not None:
        written = step.cache[0].view(-1, 2, 64)[step.slot_mapping]
        torch.testing.assert_close(written, step.k.view(-1, 2, 64), atol=0, rtol=0)
    # Once written, a later step reads the same keys without writing.
    step.k = step.v = None
    torch.testing.assert_close(step.run(backend), out, **_tolerance(dtype))


@pytest.mark.parametrize("name", ["naive", *BACKENDS])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", ["read-only", "some-write"])
def test_paged_cross_sees_only_its_own_blocks(name, device, mix):
    """Values in blocks no sequence owns (the padding of the block tables and of the decode batch, too)
    change nothing."""
    dtype = _dtype_for(name)
    backend, block_size = _backend(name, device, dtype, 32, 4, 4)
    clean = CrossStep(PAGED_CROSS_MIXES[mix], 4, 4, 32, dtype, device, block_size).run(backend)
    noisy = CrossStep(PAGED_CROSS_MIXES[mix], 4, 4, 32, dtype, device, block_size, unowned_fill=1e4).run(backend)
    torch.testing.assert_close(noisy, clean, atol=0, rtol=0)
