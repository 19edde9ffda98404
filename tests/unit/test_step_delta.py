"""Generation steps as deltas (executor/step_delta.py): what the worker rebuilds from each delta, sent through
the codec, is the scheduler's whole StepBatch, step after step, through chunked prefills, decodes, finishes,
preemptions by recompute and a second (fixed) KV group; decodes send no token and no unchanged table; a
fresh worker (a restart) or a reset after a failed step gets every sequence whole. No torch here."""

from __future__ import annotations

import random

import numpy as np
import pytest

from embedserv.executor.messages import CODEC, RunGenerationStep
from embedserv.executor.step_delta import DeltaEncoder, RunningBatch
from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind, StepBatch, StepOutput
from embedserv.types import SamplingParams

SAMPLING = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.8, top_k=5, seed=3)]


def _sampled(batch: StepBatch, step: int) -> StepOutput:
    """What a worker would sample: a token that depends on the request and the step."""
    ids = tuple(s.request_id for s in batch.sequences if s.produces_output)
    return StepOutput((), np.zeros((0, 0), np.float32), ids, np.array([7 * i + step for i in ids], np.int64))


def _through_codec(delta):
    return CODEC.decode([bytes(f) for f in CODEC.encode(RunGenerationStep(0, delta))]).delta


def _run(scheduler: GenerationScheduler, rng: random.Random, steps: int, encoder, worker, restart_at=()) -> int:
    """Drives `steps` steps; every rebuilt step must equal the scheduler's. Returns the preemptions seen."""
    lengths: dict[int, int] = {}
    for step in range(steps):
        if step in restart_at:  # a new worker process: a new encoder and an empty running batch
            encoder, worker = DeltaEncoder(), RunningBatch()
        batch = scheduler.schedule()
        if batch is None:
            continue
        delta = _through_codec(encoder.encode(batch))
        assert worker.apply(delta) == batch
        assert len(worker) == batch.num_sequences
        output = _sampled(batch, step)
        worker.record(output)
        scheduler.update(batch, output.sampled())
        for rid in output.sampled_request_ids:
            lengths[rid] = lengths.get(rid, 0) + 1
            if lengths[rid] >= 3 + rid % 5 or rng.random() < 0.05:  # done (max_tokens, EOS) or cancelled
                scheduler.finish(rid)
    return scheduler.num_preemptions


def _scheduler(num_blocks: int, groups: tuple[KvGroup, ...] | None = None) -> GenerationScheduler:
    groups = groups or (KvGroup(4),)
    return GenerationScheduler(KvCacheManager(list(groups), num_blocks), max_batch_tokens=24, max_num_seqs=8)


def _add(scheduler: GenerationScheduler, rng: random.Random, count: int, first_id: int = 0, encoder: bool = False):
    for rid in range(first_id, first_id + count):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        enc = [rng.randrange(1000) for _ in range(rng.randint(1, 6))] if encoder else []
        scheduler.add(Request(rid, prompt, OutputKind.SAMPLE, SAMPLING[rid % 2], encoder_token_ids=enc))


@pytest.mark.parametrize("seed", range(6))
def test_the_worker_rebuilds_every_step_through_preemptions(seed: int):
    rng = random.Random(seed)
    # 12 blocks of 4 tokens: far less than 30 requests of up to 27 tokens need at once.
    scheduler = _scheduler(12)
    _add(scheduler, rng, 30)
    preemptions = _run(scheduler, rng, 400, DeltaEncoder(), RunningBatch())
    assert scheduler.num_waiting == scheduler.num_running == 0
    assert preemptions > 0


def test_a_fixed_group_and_encoder_inputs_travel_once():
    rng = random.Random(1)
    scheduler = _scheduler(40, (KvGroup(4), KvGroup(4, fixed=True)))
    _add(scheduler, rng, 12, encoder=True)
    _run(scheduler, rng, 300, DeltaEncoder(), RunningBatch())
    assert scheduler.num_waiting == scheduler.num_running == 0


def test_a_new_worker_process_is_sent_everything_whole():
    rng = random.Random(2)
    scheduler = _scheduler(64)
    _add(scheduler, rng, 20)
    _run(scheduler, rng, 300, DeltaEncoder(), RunningBatch(), restart_at=(3, 4, 9))
    assert scheduler.num_waiting == scheduler.num_running == 0


def test_decodes_send_neither_tokens_nor_unchanged_tables():
    scheduler = _scheduler(64)
    scheduler.add(Request(0, [1, 2, 3], OutputKind.SAMPLE, SAMPLING[0]))
    scheduler.add(Request(1, [4, 5], OutputKind.SAMPLE, SAMPLING[1]))
    encoder, worker = DeltaEncoder(), RunningBatch()
    deltas = []
    for step in range(4):
        batch = scheduler.schedule()
        deltas.append(encoder.encode(batch))
        worker.record(output := _sampled(worker.apply(deltas[-1]), step))
        scheduler.update(batch, output.sampled())
    first, decode = deltas[0], deltas[1]
    assert first.reset and len(first.new) == 2
    assert not decode.reset and decode.new == () and len(decode.token_ids) == 0
    assert decode.request_ids.tolist() == [0, 1] and decode.num_tokens.tolist() == [1, 1]
    # Request 0 (3 prompt tokens) reaches its second block (4 tokens a block) with its fifth token, in step 2.
    assert decode.new_blocks.tolist() == [[0], [0]] and len(decode.blocks) == 0
    assert deltas[2].new_blocks.tolist() == [[1], [0]] and len(deltas[2].blocks) == 1
    scheduler.finish(0)
    last = encoder.encode(scheduler.schedule())
    assert last.dropped.tolist() == [0] and last.request_ids.tolist() == [1]


def test_a_reset_after_a_failed_step_starts_over_and_a_stranger_is_refused():
    scheduler = _scheduler(64)
    scheduler.add(Request(0, [1, 2, 3], OutputKind.SAMPLE, SAMPLING[0]))
    encoder, worker = DeltaEncoder(), RunningBatch()
    batch = scheduler.schedule()
    worker.record(output := _sampled(worker.apply(encoder.encode(batch)), 0))
    scheduler.update(batch, output.sampled())
    batch = scheduler.schedule()
    continuing = encoder.encode(batch)
    with pytest.raises(ValueError, match="does not hold"):
        RunningBatch().apply(continuing)  # a worker that never saw request 0
    encoder.reset()  # the engine saw the step fail
    again = encoder.encode(batch)
    assert again.reset and [s.request_id for s in again.new] == [0]
    assert worker.apply(again) == batch and len(worker) == 1
