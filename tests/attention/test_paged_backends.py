"""The extend/decode case: queries shorter than keys, keys and values read from the paged KV cache.

Each sequence has `start` tokens already in the cache (written there beforehand, in blocks scattered over
the cache) and `new` tokens computed this step. The oracle is the naive backend over the whole sequence
without a cache (causal), whose last `new` rows the step must reproduce; every backend must also leave
the new keys and values in their slots, agree with a plain per-token gather of the cache and with the
naive backend's own paged path, and give the same answer when a shared layer reads what another wrote.
"""

import numpy as np
import pytest
import torch

from embedserv.attention.backends.base import kv_cache_shape
from embedserv.attention.backends.naive import NaiveBackend, future_mask
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, build_paged_metadata, cumulative_offsets
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import COMPILED_FLEX_DEVICES, DEVICES, HEAD_IDS, HEADS, TOLERANCE, make_backend
from tests.helpers.matrix import matrix

BLOCK_SIZE = 16
# Blocks in the test cache: at least this many, and twice what the sequences need (so most are unowned).
MIN_BLOCKS = 64
# (tokens already cached, new tokens) per sequence.
MIXES = {
    "decodes": [(10, 1), (33, 1), (0, 1), (47, 1)],
    "prefills": [(0, 7), (0, 40)],
    "mixed": [(0, 7), (20, 1), (15, 9), (0, 1), (40, 1), (16, 16)],
    "chunks": [(32, 20), (5, 60), (63, 1)],
}
BACKENDS = ["naive", "sdpa", "cpu_varlen", "flex-eager", "varlen", "flash_attn"]


def _tensors(total_lens, heads, kv_heads, head_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda width: [torch.randn(n, width, generator=gen).to(device, dtype) for n in total_lens]  # noqa: E731
    return make(heads * head_size), make(kv_heads * head_size), make(kv_heads * head_size)


def _block_tables(total_lens, block_size, num_blocks, seed=0):
    """Distinct blocks for every sequence, in a shuffled order (tables are not contiguous)."""
    order = np.random.default_rng(seed).permutation(num_blocks).tolist()
    tables = []
    for n in total_lens:
        count = -(-n // block_size)
        tables.append(order[:count])
        order = order[count:]
    return tables


def _slots(table, start, stop, block_size):
    """Cache slots of positions start..stop-1 of a sequence with this block table."""
    positions = np.arange(start, stop)
    return np.asarray(table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def _padded(tables):
    """[num_seqs, longest + 1] int32, padded with 0: one column more than any sequence needs."""
    out = np.zeros((len(tables), max(map(len, tables)) + 1), dtype=np.int32)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return out


class Step:
    """One paged step: the cache with every context written, the step's inputs and its metadata."""

    def __init__(
        self, mix, heads, kv_heads, head_size, dtype, device, block_size=BLOCK_SIZE, unowned_fill=0.0, shared=0
    ):
        """`shared`: the first two sequences share their first `shared` blocks, as prefix caching does."""
        self.starts = [s for s, _ in mix]
        self.news = [n for _, n in mix]
        self.totals = [s + n for s, n in mix]
        self.block_size = block_size
        self.qs, self.ks, self.vs = _tensors(self.totals, heads, kv_heads, head_size, dtype, device)
        needed = sum(-(-n // block_size) for n in self.totals)
        self.tables = _block_tables(self.totals, block_size, max(MIN_BLOCKS, 2 * needed))
        if shared:
            self.tables[1][:shared] = self.tables[0][:shared]
            prefix = shared * block_size
            self.ks[1][:prefix], self.vs[1][:prefix] = self.ks[0][:prefix], self.vs[0][:prefix]
        shape = kv_cache_shape(max(MIN_BLOCKS, 2 * needed), block_size, kv_heads, head_size)
        self.cache = torch.full(shape, unowned_fill, dtype=dtype, device=device)
        self.cache[:, [b for table in self.tables for b in table]] = 0
        flat_k, flat_v = self._flat(self.cache)
        for table, start, k, v in zip(self.tables, self.starts, self.ks, self.vs, strict=True):
            slots = torch.from_numpy(_slots(table, 0, start, block_size)).to(device)
            flat_k[slots] = k[:start].view(-1, kv_heads, head_size)
            flat_v[slots] = v[:start].view(-1, kv_heads, head_size)
        to = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731
        self.slot_mapping = to(
            np.concatenate(
                [_slots(t, s, n, block_size) for t, s, n in zip(self.tables, self.starts, self.totals, strict=True)]
            )
        )
        news, totals = np.array(self.news), np.array(self.totals)
        self.common = build_paged_metadata(
            news,
            totals,
            to(cumulative_offsets(news)),
            to(cumulative_offsets(totals)),
            self.slot_mapping,
            torch.from_numpy(_padded(self.tables)).to(device),
            to(totals),
            block_size,
        )
        self.layer = Attention(heads, head_size, num_kv_heads=kv_heads)
        self.q = torch.cat([q[s:] for q, s in zip(self.qs, self.starts, strict=True)])
        self.k = torch.cat([k[s:] for k, s in zip(self.ks, self.starts, strict=True)])
        self.v = torch.cat([v[s:] for v, s in zip(self.vs, self.starts, strict=True)])

    def _flat(self, cache):
        return cache[0].view(-1, *cache.shape[-2:]), cache[1].view(-1, *cache.shape[-2:])

    def run(self, backend, shared: bool = False) -> torch.Tensor:
        """The step's output [num_new, H*D] as float32 on CPU; `shared`: as a layer that reads this cache
        and brings no keys of its own (the keys must have been written by an earlier run)."""
        context = forward_context_for(
            [self.layer], backend, backend.build_metadata(self.common), kv_caches=[self.cache]
        )
        with set_forward_context(context):
            k, v = (None, None) if shared else (self.k, self.v)
            return self.layer(self.q, k, v).float().cpu()

    def full_causal(self) -> torch.Tensor:
        """The naive oracle over each whole sequence without a cache: its last `new` rows."""
        oracle = NaiveBackend()
        expected = []
        for q_full, k_full, v_full, start, total in zip(
            self.qs, self.ks, self.vs, self.starts, self.totals, strict=True
        ):
            meta = oracle.build_metadata(build_common_metadata(np.array([total]), is_causal=True))
            with set_forward_context(forward_context_for([self.layer], oracle, meta)):
                expected.append(self.layer(q_full, k_full, v_full)[start:].float().cpu())
        return torch.cat(expected)

    def gathered(self) -> torch.Tensor:
        """A plain reference: every key gathered slot by slot from the cache, attention in float64."""
        flat_k, flat_v = self._flat(self.cache)
        heads, size = self.layer.num_heads, self.layer.head_size
        q = self.q.view(-1, heads, size).double()
        out, row = [], 0
        for table, new, total in zip(self.tables, self.news, self.totals, strict=True):
            slots = torch.from_numpy(_slots(table, 0, total, self.block_size)).to(q.device)
            group = heads // flat_k.shape[1]
            keys = flat_k[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
            values = flat_v[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = q[row : row + new].transpose(0, 1) @ keys.transpose(1, 2) * self.layer.scale
            scores = scores.masked_fill(future_mask(new, total, q.device), float("-inf"))
            out.append((scores.softmax(-1) @ values).transpose(0, 1).reshape(new, -1))
            row += new
        return torch.cat(out).float().cpu()


def _backend(name, device, dtype, head_size, heads, kv_heads, block_size=None):
    """(backend, block size): `block_size` or skip where the backend cannot read it; by default BLOCK_SIZE,
    or the backend's own default where it cannot read BLOCK_SIZE."""
    backend = NaiveBackend() if name == "naive" else make_backend(name, device, dtype, head_size, heads, kv_heads, True)
    try:
        backend.check_block_size(block_size or BLOCK_SIZE, torch.device(device))
    except ValueError as error:
        if block_size is not None:
            pytest.skip(str(error))
        return backend, backend.default_block_size
    return backend, block_size or BLOCK_SIZE


# The whole matrix runs with --run-slow; the default run, its pairwise cover (tests/helpers/matrix.py).
@matrix(
    "name,device,mix,heads,kv_heads,head_size,dtype",
    [BACKENDS, DEVICES, list(MIXES), HEADS, [32, 64], [torch.float32, torch.bfloat16]],
    ids=[None, None, None, lambda h: HEAD_IDS[HEADS.index(h)]],
    spread=(3,),
)
def test_paged_step_matches_full_causal_attention(name, device, mix, heads, kv_heads, head_size, dtype):
    backend, block_size = _backend(name, device, dtype, head_size, heads, kv_heads)
    step = Step(MIXES[mix], heads, kv_heads, head_size, dtype, device, block_size)
    out = step.run(backend)
    tolerance = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(out, step.full_causal(), **tolerance)
    written = step.cache[0].view(-1, kv_heads, head_size)[step.slot_mapping]
    torch.testing.assert_close(written, step.k.view(-1, kv_heads, head_size), atol=0, rtol=0)
    # Read through the block tables, the same as read slot by slot, and as the oracle's paged path.
    torch.testing.assert_close(out, step.gathered(), **tolerance)
    torch.testing.assert_close(out, step.run(NaiveBackend()), **tolerance)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [256, 12, 48])
@pytest.mark.parametrize("mix", ["mixed", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_step_at_other_block_sizes(name, device, block_size, mix, dtype):
    """A block larger than any sequence, and sizes that are not powers of two, where the backend reads them."""
    backend, _ = _backend(name, device, dtype, 64, 8, 2, block_size)
    step = Step(MIXES[mix], 8, 2, 64, dtype, device, block_size=block_size)
    out = step.run(backend)
    tolerance = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(out, step.full_causal(), **tolerance)
    torch.testing.assert_close(out, step.gathered(), **tolerance)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", list(MIXES), ids=list(MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_layer_reads_what_another_wrote(name, device, mix, dtype):
    """A layer with no keys of its own (k = v = None) over a cache an earlier layer wrote this step gives
    that layer's answer and writes nothing."""
    backend, block_size = _backend(name, device, dtype, 64, 8, 2)
    step = Step(MIXES[mix], 8, 2, 64, dtype, device, block_size)
    owner = step.run(backend)
    before = step.cache.clone()
    shared = step.run(backend, shared=True)
    torch.testing.assert_close(step.cache, before, atol=0, rtol=0)
    torch.testing.assert_close(shared, owner, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(shared, step.full_causal(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_sequences_sharing_prefix_blocks(name, device):
    """Prefix caching: two sequences of one step list the same first blocks (at the same positions)."""
    dtype = torch.float32 if name in ("naive", "sdpa", "cpu_varlen", "flex-eager") else torch.bfloat16
    backend, block_size = _backend(name, device, dtype, 64, 8, 2)
    shared = 2 if block_size <= 16 else 1
    mix = [(2 * block_size + 8, 1), (2 * block_size + 3, 5), (20, 1), (0, 9)]
    step = Step(mix, 8, 2, 64, dtype, device, block_size, shared=shared)
    out = step.run(backend)
    torch.testing.assert_close(out, step.full_causal(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(out, step.gathered(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_step_sees_only_its_own_blocks(name, device):
    """Values in blocks no sequence owns (including the padding of the block tables and of the decode
    batch) change nothing."""
    # The flash kernels run half precision only.
    dtype = torch.float32 if name in ("naive", "sdpa", "cpu_varlen", "flex-eager") else torch.bfloat16
    backend, block_size = _backend(name, device, dtype, 32, 4, 4)
    clean = Step(MIXES["mixed"], 4, 4, 32, dtype, device, block_size).run(backend)
    noisy = Step(MIXES["mixed"], 4, 4, 32, dtype, device, block_size, unowned_fill=1e4).run(backend)
    torch.testing.assert_close(noisy, clean, atol=0, rtol=0)


# Long enough for query blocks of one sequence, whose earlier cache blocks FlexAttention sees whole.
_LONG_MIX = [(300, 200), (0, 150), (40, 1), (130, 1)]


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
@pytest.mark.parametrize(
    "dtype,block_size,shared",
    [(torch.float32, 16, 0), (torch.bfloat16, 12, 0), (torch.bfloat16, 48, 0), (torch.float32, 16, 3)],
    ids=["fp32-16", "bf16-12", "bf16-48", "fp32-16-shared-prefix"],
)
def test_compiled_flex_reads_the_paged_cache(device, dtype, block_size, shared):
    """The compiled kernel visits only the blocks the BlockMask lists (eager FlexAttention scores them all),
    each once, also where two sequences list the same prefix blocks."""
    backend, _ = _backend("flex", device, dtype, 64, 8, 2, block_size)
    step = Step(_LONG_MIX, 8, 2, 64, dtype, device, block_size=block_size, shared=shared)
    out = step.run(backend)
    torch.testing.assert_close(out, step.full_causal(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(step.run(backend, shared=True), out, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("device", COMPILED_FLEX_DEVICES)
def test_compiled_flex_is_not_recompiled_as_the_batch_changes(device):
    """Steps of one query size class over one cache compile once, whatever their sequences and tables:
    torch stops compiling after a few entries and falls back to eager FlexAttention over the whole cache."""
    from torch._dynamo.utils import counters

    backend, _ = _backend("flex", device, torch.float32, 64, 8, 2, BLOCK_SIZE)
    mixes = [[(10, 1), (33, 1)], [(100, 1), (3, 1), (50, 1)], [(0, 20), (200, 1)], [(40, 30), (7, 1), (9, 1)]]
    Step(mixes[0], 8, 2, 64, torch.float32, device).run(backend)
    graphs = counters["stats"]["unique_graphs"]
    for mix in mixes[1:]:
        step = Step(mix, 8, 2, 64, torch.float32, device)
        assert step.cache.shape[1] == MIN_BLOCKS
        torch.testing.assert_close(step.run(backend), step.full_causal(), atol=2e-5, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("name", ["naive", "sdpa", "flex", "varlen", "flash_attn"])
def test_every_backend_reads_its_default_block_size_in_the_one_layout(name):
    """Imported even where the backend cannot run (varlen on CPU), so its module stays importable."""
    module = pytest.importorskip(f"embedserv.attention.backends.{name}")
    backend = next(v for v in vars(module).values() if isinstance(v, type) and getattr(v, "name", None) == name)()
    size = backend.default_block_size
    for device in (torch.device("cpu"), torch.device("cuda")):
        backend.check_block_size(size, device)
        with pytest.raises(ValueError):
            backend.check_block_size(0, device)
    assert backend.kv_cache_shape(7, size, 2, 64) == kv_cache_shape(7, size, 2, 64) == (2, 7, size, 2, 64)


def test_compiled_flex_on_cuda_refuses_blocks_its_key_tiles_would_span():
    """Triton's flex kernel tiles keys 16 or more at a time, each tile inside one cache block: on CUDA the
    block size is a multiple of 16 (found on an H100: a 16-token block with the default 64-key tile failed
    to compile). On CPU, and eagerly, any size reads."""
    from embedserv.attention.backends.flex import FlexBackend

    with pytest.raises(ValueError, match="multiple of 16 tokens on cuda, not 12"):
        FlexBackend().check_block_size(12, torch.device("cuda"))
    FlexBackend().check_block_size(48, torch.device("cuda"))
    FlexBackend().check_block_size(12, torch.device("cpu"))
    FlexBackend(compile=False).check_block_size(12, torch.device("cuda"))
