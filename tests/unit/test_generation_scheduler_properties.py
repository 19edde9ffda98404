"""The generation scheduler under random workloads: thousands of arrivals, cancellations and finishes.

A fake runner checks that every chunk sees the KV of its whole context in its block table; after every
step no block is leaked or owned twice. No torch here.
"""

import random
from collections import defaultdict

import pytest

from embedserv.scheduler.block_manager import BlockManager
from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.request import Request, RequestStatus
from embedserv.steps import OutputKind, StepBatch
from embedserv.types import SamplingParams
from tests.unit.test_generation_scheduler import _scheduler

VOCAB = 50


def _fingerprints(token_ids: list[int]) -> list[int]:
    """fingerprints[p] stands for the KV of token p: it depends on every token up to p."""
    out, running = [], 0
    for token in token_ids:
        running = hash((running, token))
        out.append(running)
    return out


class _FakeRunner:
    """Keeps a fingerprint per KV slot; checks each chunk's context is in its block table."""

    def __init__(self, block_manager: BlockManager, rng: random.Random) -> None:
        self.block_manager = block_manager
        self.rng = rng
        self.kv: dict[int, dict[int, int]] = defaultdict(dict)

    def run(self, batch: StepBatch, requests: dict[int, Request]) -> dict[int, int]:
        size = self.block_manager.block_size
        sampled = {}
        for chunk in batch.sequences:
            tokens = requests[chunk.request_id].all_token_ids()
            fingerprints = _fingerprints(tokens)
            end = chunk.start_position + len(chunk.token_ids)
            assert chunk.token_ids == tuple(tokens[chunk.start_position : end])
            for pos in range(chunk.start_position):
                assert self.kv[chunk.block_ids[0][pos // size]].get(pos % size) == fingerprints[pos], "stale KV"
            for pos in range(chunk.start_position, end):
                block = chunk.block_ids[0][pos // size]
                assert self.block_manager.ref_count(block) == 1, "writing into a shared block"
                self.kv[block][pos % size] = fingerprints[pos]
            if chunk.produces_output:
                sampled[chunk.request_id] = self.rng.randrange(VOCAB)
        return sampled


def _check_tables(s: GenerationScheduler, live: list[Request], batch: StepBatch | None) -> None:
    bm = s.kv_cache.managers[0]
    bm.check_invariants()
    scheduled = {c.request_id: len(c.token_ids) for c in batch.sequences} if batch else {}
    owners: dict[int, int] = defaultdict(int)
    for request in live:
        if request.status is RequestStatus.WAITING:
            assert request.block_ids == [] and request.num_computed_tokens == 0
            continue
        assert request.status is RequestStatus.RUNNING
        covered = request.num_computed_tokens + scheduled.get(request.request_id, 0)
        assert len(request.block_ids[0]) == bm.blocks_needed(covered)
        for block in request.block_ids[0]:
            owners[block] += 1
    for block, count in owners.items():
        assert bm.ref_count(block) == count
        assert count == 1 or bm.is_cached(block), "shared block that is not a cached prefix block"
    assert sum(bm.ref_count(b) for b in range(bm.num_blocks)) == sum(owners.values())
    assert s.num_running <= s.max_num_seqs
    assert s.num_running + s.num_waiting == len(live)


def _check_batch(s: GenerationScheduler, batch: StepBatch, requests: dict[int, Request]) -> None:
    assert batch.num_tokens <= s.max_batch_tokens and batch.num_sequences <= s.max_num_seqs
    assert len({c.request_id for c in batch.sequences}) == batch.num_sequences
    for chunk in batch.sequences:
        request = requests[chunk.request_id]
        assert request.status is RequestStatus.RUNNING and len(chunk.token_ids) > 0
        assert chunk.start_position == request.num_computed_tokens
        assert chunk.block_ids == tuple(tuple(table) for table in request.block_ids)
        assert chunk.produces_output == (chunk.start_position + len(chunk.token_ids) == request.num_tokens)


class _Workload:
    def __init__(self, seed: int, num_blocks: int, block_size: int, caching: bool) -> None:
        self.rng = random.Random(seed)
        budget, max_num_seqs = self.rng.choice([8, 16, 32]), self.rng.choice([3, 4, 8])
        self.s = _scheduler(num_blocks, block_size, budget, max_num_seqs, caching)
        self.runner = _FakeRunner(self.s.kv_cache.managers[0], self.rng)
        num_prefixes, longest = (3, 3 * block_size) if caching else (1, 0)
        # Prompts start with one of a few shared prefixes so the prefix cache gets hits.
        self.prefixes = [self._random_tokens(0, longest) for _ in range(num_prefixes)]
        self.requests: dict[int, Request] = {}
        self.live: list[Request] = []
        self.cancelled: set[int] = set()
        self.cache_hits = 0

    def _random_tokens(self, min_len: int, max_len: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(min_len, max_len))]

    def arrive(self) -> None:
        prompt = self.rng.choice(self.prefixes) + self._random_tokens(1, 12)
        max_tokens = self.rng.randint(1, 12)
        request = Request(len(self.requests), prompt, OutputKind.SAMPLE, SamplingParams(max_tokens=max_tokens))
        if not self.s.can_ever_fit(request, len(prompt) + max_tokens):
            return  # the engine refuses it
        self.requests[request.request_id] = request
        self.live.append(request)
        self.s.add(request)

    def finish(self, request: Request, cancelled: bool) -> None:
        self.s.finish(request.request_id)
        assert request.status is RequestStatus.FINISHED and request.block_ids == []
        self.live.remove(request)
        if cancelled:
            self.cancelled.add(request.request_id)

    def maybe_cancel(self, probability: float) -> None:
        if self.live and self.rng.random() < probability:
            self.finish(self.rng.choice(self.live), cancelled=True)

    def step(self, cancel_probability: float) -> bool:
        was_running = {r.request_id for r in self.live if r.status is RequestStatus.RUNNING}
        batch = self.s.schedule()
        _check_tables(self.s, self.live, batch)
        if batch is None:
            return False
        _check_batch(self.s, batch, self.requests)
        admitted = [c for c in batch.sequences if c.request_id not in was_running]
        self.cache_hits += sum(1 for c in admitted if c.start_position > 0)
        sampled = self.runner.run(batch, self.requests)
        self.maybe_cancel(cancel_probability)  # between schedule() and update()
        self.s.update(batch, sampled)
        for request in list(self.live):
            assert len(request.output_token_ids) <= request.max_tokens
            if len(request.output_token_ids) == request.max_tokens:
                self.finish(request, cancelled=False)
        self.maybe_cancel(cancel_probability)
        _check_tables(self.s, self.live, None)
        return True

    def run(self, num_arrivals: int) -> None:
        while len(self.requests) < num_arrivals:
            for _ in range(self.rng.choice([0, 0, 1, 1, 2])):
                self.arrive()
            self.step(cancel_probability=0.05)
        for _ in range(100_000):
            if not self.live:
                break
            assert self.step(cancel_probability=0.0), "requests left that never run"
        assert not self.live and self.s.num_running == self.s.num_waiting == 0
        assert self.s.kv_cache.num_used_blocks == 0
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED
            if request.request_id not in self.cancelled:
                assert len(request.output_token_ids) == request.max_tokens


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_small_cache_preempts(seed, caching):
    workload = _Workload(seed, num_blocks=12, block_size=4, caching=caching)
    workload.run(num_arrivals=700)
    assert workload.s.num_preemptions > 0
    assert sum(r.num_preemptions for r in workload.requests.values()) == workload.s.num_preemptions
    assert workload.cancelled
    if caching:
        assert workload.cache_hits > 0


@pytest.mark.parametrize("block_size", [1, 3])
def test_random_workload_roomy_cache_with_prefix_caching(block_size):
    workload = _Workload(seed=block_size, num_blocks=120 // block_size, block_size=block_size, caching=True)
    workload.run(num_arrivals=700)
    assert workload.cache_hits > 0
