"""--kv-sharing-fast-prefill on a toy model made of our Attention layers: its last two layers read layer 1's
KV. The layers after the last KV writer run exactly the sampled / pooled rows (counted by hooks); their
outputs equal the unskipped run's; shared layers never read or write a cache of their own (poisoned)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.layer import Attention, link_kv_sharing
from embedserv.models.heads.pooling import EmbeddingPooler
from embedserv.models.interface import DecoderModel
from embedserv.models.layers import padded_rows
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
from embedserv.types import SamplingParams
from embedserv.worker.kv_cache import KvCache, allocate_kv_caches, kv_cache_groups
from embedserv.worker.model_runner import ModelRunner

HIDDEN, HEADS, HEAD_SIZE, VOCAB, BLOCK = 32, 2, 16, 61, 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8)


class _Layer(nn.Module):
    def __init__(self, index: int, source: int | None, window: int | None) -> None:
        super().__init__()
        self.source = source
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_SIZE)
        self.kv = None if source is not None else nn.Linear(HIDDEN, 2 * HEADS * HEAD_SIZE)
        self.attn = Attention(HEADS, HEAD_SIZE, layer_index=index, kv_source_layer=source, sliding_window=window)
        self.out = nn.Linear(HEADS * HEAD_SIZE, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = v = None
        if self.kv is not None:
            k, v = self.kv(x).chunk(2, dim=-1)
        return x + torch.tanh(self.out(self.attn(self.q(x), k, v)))


class ToyModel(nn.Module, DecoderModel):
    """Four layers; 2 and 3 read layer 1's KV (layer 3 through a window), so layer 2 is the skip layer."""

    max_positions = 512
    prefill_skip_layer = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(512, HIDDEN)
        self.layers = nn.ModuleList([_Layer(0, None, None), _Layer(1, None, 5), _Layer(2, 1, None), _Layer(3, 1, 5)])
        link_kv_sharing([layer.attn for layer in self.layers])

    def forward(self, input_ids, positions, prefill_skip_rows=None) -> torch.Tensor:
        hidden = self.embed(input_ids) + self.positions(positions)
        for index, layer in enumerate(self.layers):
            if index == self.prefill_skip_layer and prefill_skip_rows is not None:
                hidden = hidden.index_select(0, prefill_skip_rows)
            hidden = layer(hidden)
        return hidden


def _runner(backend, skip: bool, pooling: str | None = None, kv: bool = True, pad_rows: bool = False):
    """Rows unpadded unless `pad_rows` (models/layers.py): these tests count the rows each layer runs."""
    torch.manual_seed(0)
    model = ToyModel().eval()
    kv_cache = None
    if kv:
        groups = kv_cache_groups(model, BLOCK, torch.float32)
        kv_cache = KvCache(allocate_kv_caches(model, groups, 40, backend, CPU), groups, 40)
    lm_head = nn.Linear(HIDDEN, VOCAB) if kv else None
    row_head = EmbeddingPooler(pooling, []) if pooling else None
    return ModelRunner(
        model,
        backend,
        CPU,
        True,
        row_head=row_head,
        lm_head=lm_head,
        kv_cache=kv_cache,
        kv_sharing_fast_prefill=skip,
        rows_read_last=pooling == "lasttoken",
        pad_rows=pad_rows,
    )


def _count_rows(runner) -> dict[int, list[int]]:
    """Rows each layer's forward receives, per call."""
    seen: dict[int, list[int]] = {i: [] for i in range(4)}
    for index, layer in enumerate(runner.model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=index: seen[i].append(args[0].shape[0]))
    return seen


def _lm_inputs(runner) -> list[torch.Tensor]:
    captured = []
    runner.lm_head.register_forward_hook(lambda module, args, out: captured.append(args[0].clone()))
    return captured


def _seq(rid, tokens, start, table, produces=True):
    return ScheduledSequence(
        rid, tuple(tokens), OutputKind.SAMPLE, start, (tuple(table),), produces, GREEDY if produces else None
    )


def _steps():
    """Three requests: A (13 tokens) in two chunks, B (6) whole, then both decode with C mid-prompt."""
    a, b, c = list(range(3, 16)), list(range(20, 26)), list(range(30, 39))
    a_table, b_table, c_table = list(range(1, 5)), list(range(5, 7)), list(range(8, 11))
    yield StepBatch((_seq(0, a[:8], 0, a_table[:2], produces=False), _seq(1, b, 0, b_table)))
    yield StepBatch((_seq(0, a[8:], 8, a_table), _seq(1, [7], 6, b_table), _seq(2, c[:5], 0, c_table[:2], False)))
    yield StepBatch((_seq(0, [9], 13, a_table), _seq(1, [8], 7, b_table), _seq(2, c[5:], 5, c_table)))


@pytest.mark.parametrize("backend", [NaiveBackend(), SdpaBackend()], ids=["naive", "sdpa"])
def test_generation_steps_run_only_sampled_rows_after_the_last_writer(backend):
    full, skipped = _runner(backend, skip=False), _runner(backend, skip=True)
    full_rows, skipped_rows = _count_rows(full), _count_rows(skipped)
    full_lm, skipped_lm = _lm_inputs(full), _lm_inputs(skipped)
    # Poison: a tensor where each shared layer would keep its cache; reading or writing it would show.
    for layer in (2, 3):
        skipped.kv_cache.tensors[layer] = torch.full_like(skipped.kv_cache.tensors[1], math.nan)
    for step in _steps():
        want, got = full.execute(step), skipped.execute(step)
        assert got.sampled_request_ids == want.sampled_request_ids
        assert got.tokens.tolist() == want.tokens.tolist()
    for before, after in zip(full_lm, skipped_lm, strict=True):
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    tokens = [8 + 6, 5 + 1 + 5, 1 + 1 + 4]
    sampled = [1, 2, 3]
    for layer in (0, 1):
        assert full_rows[layer] == skipped_rows[layer] == tokens
    for layer in (2, 3):
        assert full_rows[layer] == tokens
        assert skipped_rows[layer] == sampled, "the layers after the last writer run only the sampled rows"
    for layer in (2, 3):
        assert torch.isnan(skipped.kv_cache.tensors[layer]).all(), "a shared layer touched a cache of its own"
    # The source layer's cache holds the same keys and values, slot for slot (A: 14, B: 8, C: 9 tokens).
    written = [
        b * BLOCK + i
        for b, n in ((1, 4), (2, 4), (3, 4), (4, 2), (5, 4), (6, 4), (8, 4), (9, 4), (10, 1))
        for i in range(n)
    ]
    source = [r.kv_cache.tensors[1].flatten(1, 2)[:, written] for r in (full, skipped)]
    torch.testing.assert_close(source[1], source[0], rtol=0, atol=0)


def test_a_step_that_samples_nothing_keeps_one_row():
    runner = _runner(SdpaBackend(), skip=True)
    rows = _count_rows(runner)
    out = runner.execute(StepBatch((_seq(0, range(3, 11), 0, [1, 2], produces=False),)))
    assert out.sampled_request_ids == () and rows[2] == [1]


@pytest.mark.parametrize("backend", [NaiveBackend(), SdpaBackend()], ids=["naive", "sdpa"])
@pytest.mark.parametrize("pooling, kept", [("lasttoken", [3]), ("mean", [7 + 5 + 3])])
def test_prefill_only_steps_keep_the_rows_the_head_reads(pooling, kept, backend):
    """KV-free: the shared layers attend over layer 1's k and v of every token; a last-token head keeps one
    row a sequence, a mean-pooling head every row (no skip)."""
    batch = StepBatch(
        tuple(ScheduledSequence(i, tuple(range(3 + i, 3 + i + n)), OutputKind.POOL) for i, n in enumerate((7, 5, 3)))
    )
    full = _runner(backend, skip=False, pooling=pooling, kv=False)
    skipped = _runner(backend, skip=True, pooling=pooling, kv=False)
    rows = _count_rows(skipped)
    want, got = full.execute(batch), skipped.execute(batch)
    assert got.row_request_ids == want.row_request_ids
    assert abs(got.rows - want.rows).max() <= 1e-5
    assert rows[2] == rows[3] == kept and rows[1] == [15]


@pytest.mark.parametrize("backend", [NaiveBackend(), SdpaBackend()], ids=["naive", "sdpa"])
def test_padded_rows_change_no_output(backend):
    """On CPU the runner pads the step's rows, the kept rows and the sampled rows (models/layers.py): with
    the skip and padding it samples what the unpadded full run samples, from the same LM-head rows."""
    full, padded = _runner(backend, skip=False), _runner(backend, skip=True, pad_rows=True)
    rows = _count_rows(padded)
    full_lm, padded_lm = _lm_inputs(full), _lm_inputs(padded)
    for step in _steps():
        want, got = full.execute(step), padded.execute(step)
        assert got.sampled_request_ids == want.sampled_request_ids
        assert got.tokens.tolist() == want.tokens.tolist()
    for before, after in zip(full_lm, padded_lm, strict=True):
        assert after.shape[0] == padded_rows(before.shape[0])
        torch.testing.assert_close(after[: before.shape[0]], before, rtol=0, atol=1e-5)
    # 14, 11 and 6 tokens; 1, 2 and 3 kept rows: every layer ran 16.
    assert all(counts == [16, 16, 16] for counts in rows.values())


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_padded_rows_change_no_pooled_row(pooling):
    batch = StepBatch(
        tuple(ScheduledSequence(i, tuple(range(3 + i, 3 + i + n)), OutputKind.POOL) for i, n in enumerate((7, 5, 3)))
    )
    full = _runner(SdpaBackend(), skip=False, pooling=pooling, kv=False)
    padded = _runner(SdpaBackend(), skip=True, pooling=pooling, kv=False, pad_rows=True)
    want, got = full.execute(batch), padded.execute(batch)
    assert got.row_request_ids == want.row_request_ids
    assert abs(got.rows - want.rows).max() <= 1e-5


def test_the_flag_is_refused_for_a_model_without_shared_layers():
    model = ToyModel()
    model.prefill_skip_layer = None
    with pytest.raises(ValueError, match="kv-sharing-fast-prefill"):
        ModelRunner(model, SdpaBackend(), CPU, True, kv_sharing_fast_prefill=True)
