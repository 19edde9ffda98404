"""Row padding on CPU (models/layers.py).

A worker's memory grew without bound under steady load: oneDNN builds and caches a primitive for every
row count a linear sees, and steps of every size churned its caches and fragmented the heap. The runner
now pads rows to a bounded set of counts. These tests show the bound, that the linears (LM head included)
only ever see those counts, and that a worker running many steps of varied sizes keeps its memory flat
(it grew by hundreds of MiB over the same steps before). Outputs with padding are the reference
library's: every parity test in tests/models runs padded.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from embedserv.config import ModelConfig
from embedserv.models.heads.pooling import Dense
from embedserv.models.layers import Linear, padded_rows, row_counts
from embedserv.models.loading.st_files import DenseSpec
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
from embedserv.types import EmbedParams, SamplingParams
from tests.helpers.models import load_in_process

MAX_STEP_TOKENS = 2048
_MIB = 2**20


def test_padded_rows_are_few_and_close():
    sizes = [padded_rows(n) for n in range(1, 20_001)]
    assert all(p >= n for n, p in enumerate(sizes, 1))
    assert all(p - n < 16 for n, p in enumerate(sizes[:255], 1))
    assert all(p <= n * 1.0625 for n, p in enumerate(sizes, 1) if n >= 256)
    assert sizes == sorted(sizes)
    assert all(padded_rows(p) == p for p in set(sizes))
    assert len(set(sizes[:4096])) == 80
    # 16 sizes per power of two above 256: a token budget of 16k adds 32 more.
    assert len(set(sizes[:16384])) == 80 + 32
    assert row_counts(4096) == sorted(set(sizes[:4096])) and row_counts(4000)[-1] == 4096


def _random_steps(seed: int, count: int, max_tokens: int = MAX_STEP_TOKENS) -> list[StepBatch]:
    """Embedding steps of random sizes (1..max_tokens tokens), as sequences of 1..128 tokens."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        remaining, seqs = rng.randint(1, max_tokens), []
        while remaining:
            length = min(remaining, rng.randint(1, 128))
            remaining -= length
            tokens = tuple(rng.randrange(1000, 5000) for _ in range(length))
            seqs.append(ScheduledSequence(request_id=len(seqs), token_ids=tokens, output=OutputKind.POOL))
        steps.append(StepBatch(tuple(seqs)))
    return steps


def _rows_seen_by_linears(model: torch.nn.Module, *heads: torch.nn.Module) -> set[int]:
    seen: set[int] = set()
    for module in [*model.modules(), *heads]:
        if isinstance(module, Linear):
            module.register_forward_pre_hook(lambda _module, args: seen.add(args[0].shape[0]))
    return seen


@pytest.fixture(scope="module")
def encoder_runner(tiny_encoder):
    return load_in_process(ModelConfig(path=str(tiny_encoder("bert", "mean")), served_name="m"))


def test_embedding_steps_run_padded_row_counts(encoder_runner):
    seen = _rows_seen_by_linears(encoder_runner.model)
    steps = _random_steps(seed=1, count=60)
    for step in steps:
        out = encoder_runner.execute(step)
        assert out.rows.shape[0] == len(step.sequences)
    assert seen and all(padded_rows(n) == n for n in seen)
    assert len(seen) <= len({padded_rows(sum(len(s.token_ids) for s in step.sequences)) for step in steps})


def test_generation_steps_run_padded_row_counts(tiny_generator):
    from embedserv.engine.sync import SyncEngine

    config = ModelConfig(path=str(tiny_generator("llama")), served_name="m")
    with SyncEngine(config) as engine:
        runner = engine.core.workers[0].runner
        seen = _rows_seen_by_linears(runner.model, runner.lm_head)
        prompts = [" ".join(["word"] * n) for n in (3, 17, 40, 90, 5, 33, 61)]
        params = [SamplingParams(max_tokens=5 + i, ignore_eos=True) for i in range(len(prompts))]
        results = engine.generate_concurrently(prompts, params)
    assert [sum(len(d.token_ids) for d in deltas) for deltas in results] == [p.max_tokens for p in params]
    assert seen and all(padded_rows(n) == n for n in seen)


def _linear_calls(model: torch.nn.Module) -> dict[tuple, set[int]]:
    """Row counts each kind of Linear call (shape, activation, fused residual) ran at, as the model runs."""
    calls: dict[tuple, set[int]] = {}

    def record(module, args, kwargs):
        residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
        kind = (module.in_features, module.out_features, module.activation, residual is not None)
        calls.setdefault(kind, set()).add(args[0].shape[0])

    for module in model.modules():
        if isinstance(module, Linear):
            module.register_forward_pre_hook(record, with_kwargs=True)
    return calls


def test_warm_up_runs_every_linear_call_at_every_row_count(tiny_encoder):
    """A worker builds every oneDNN primitive its steps can need before it serves: one built mid-step sits
    between the step's buffers and keeps heap memory (docs/performance-history.md, "Memory under steady load")."""
    runner = load_in_process(ModelConfig(path=str(tiny_encoder("bert", "mean")), served_name="m"))
    calls = _linear_calls(runner.model)
    runner.warm_up(max_tokens=128, max_batch_tokens=512)
    warmed = {kind: set(rows) for kind, rows in calls.items()}
    calls.clear()
    for step in _random_steps(seed=4, count=20, max_tokens=512):
        runner.execute(step)
    assert any(kind[3] for kind in calls) and any(not kind[3] for kind in calls)  # fused residuals and not
    for kind, rows in calls.items():
        assert rows <= warmed[kind] and warmed[kind] >= set(row_counts(512)), kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_heads_run_padded_row_counts(dtype):
    """Heads whose rows are a step's sequences or tokens (here a Dense pooler layer) pad them too."""
    torch.manual_seed(0)
    dense = Dense(DenseSpec(16, 8, True, "Tanh", Path("unused"))).to(dtype)
    seen = []
    dense.linear.register_forward_pre_hook(lambda _module, args: seen.append(args[0].shape[0]))
    for rows in (1, 17, 37, 300):
        x = torch.randn(rows, 16, dtype=dtype)
        torch.testing.assert_close(dense(x), torch.tanh(dense.linear(x)))
    assert seen[::2] == [16, 32, 48, 304] and seen[1::2] == [1, 17, 37, 300]


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / _MIB


def test_memory_stays_flat_over_steps_of_varied_sizes(encoder_runner):
    """Without padding the 600 measured steps below added 4 oneDNN primitives per new row count, filled
    both caches and grew the heap by hundreds of MiB (docs/performance-history.md, "Memory under steady load")."""
    for size in sorted({padded_rows(n) for n in range(1, MAX_STEP_TOKENS + 1)}):
        # Every row count the measured steps can run, once: what a warm worker has already built.
        lengths = [128] * (size // 128) + [size % 128] * (size % 128 > 0)
        encoder_runner.execute(
            StepBatch(
                tuple(ScheduledSequence(i, (1000,) * length, OutputKind.POOL) for i, length in enumerate(lengths))
            )
        )
    for step in _random_steps(seed=2, count=100):
        encoder_runner.execute(step)
    before = _rss_mib()
    for step in _random_steps(seed=3, count=600):
        encoder_runner.execute(step)
    grown = _rss_mib() - before
    assert grown < 48, f"the worker grew by {grown:.0f} MiB over 600 steps"


def test_a_warmed_up_engine_answers_bit_for_bit_as_a_cold_one(bundled_dir, engine_for, texts):
    """The warm-up only builds what first calls would (tests/models run their engines without it)."""
    params = EmbedParams(truncate=True)
    cold = engine_for(bundled_dir).embed(texts, params).embeddings
    warm = engine_for(bundled_dir, warm_up=True).embed(texts, params).embeddings
    np.testing.assert_array_equal(warm, cold)
