"""The generation scheduler: token budget, chunked prefill, FIFO, preemption by recompute, prefix caching.

No torch here. The random workload at the bottom drives thousands of requests through a fake runner
that checks every chunk sees the KV of its whole context in its block table.
"""

import random
import subprocess
import sys
from collections import defaultdict

import pytest

from embedserv.scheduler.block_manager import BlockManager
from embedserv.scheduler.generation import (
    GenerationBatch,
    GenerationRequest,
    GenerationScheduler,
    RequestStatus,
)


def _scheduler(num_blocks=64, block_size=4, max_batch_tokens=64, max_num_seqs=16, caching=False):
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return GenerationScheduler(block_manager, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs)


def _req(request_id: int, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> GenerationRequest:
    prompt = list(range(first_token, first_token + prompt_len))
    return GenerationRequest(request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens)


def _step(s: GenerationScheduler) -> GenerationBatch:
    """One schedule + update; every sampling chunk gets token 1000 + request_id."""
    batch = s.schedule()
    assert batch is not None
    s.update(batch, {c.request_id: 1000 + c.request_id for c in batch.chunks if c.samples})
    return batch


def _sizes(batch: GenerationBatch) -> list[tuple[int, int]]:
    return [(c.request_id, len(c.token_ids)) for c in batch.chunks]


def test_token_budget_respected_with_chunked_tail():
    s = _scheduler(max_batch_tokens=10)
    for i in range(3):
        s.add(_req(i, 4))
    batch = s.schedule()
    assert _sizes(batch) == [(0, 4), (1, 4), (2, 2)]
    assert batch.num_tokens == 10 and batch.num_sequences == 3
    assert [c.samples for c in batch.chunks] == [True, True, False]


def test_decodes_go_before_new_prefills():
    s = _scheduler(max_batch_tokens=8)
    s.add(_req(0, 3))
    s.add(_req(1, 3))
    _step(s)
    s.add(_req(2, 20))
    batch = _step(s)
    assert _sizes(batch) == [(0, 1), (1, 1), (2, 6)]
    assert batch.chunks[0].token_ids == (1000,) and batch.chunks[0].start_position == 3


def test_chunked_prefill_samples_only_on_last_chunk():
    s = _scheduler(block_size=4, max_batch_tokens=4)
    request = _req(0, 10, first_token=100)
    s.add(request)
    chunks = [_step(s).chunks[0] for _ in range(3)]
    assert [c.start_position for c in chunks] == [0, 4, 8]
    assert [c.token_ids for c in chunks] == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert [c.samples for c in chunks] == [False, False, True]
    assert [len(c.block_ids) for c in chunks] == [1, 2, 3]
    assert chunks[2].block_ids[:2] == chunks[1].block_ids
    assert request.output_token_ids == [1000] and request.num_computed_tokens == 10
    decode = _step(s).chunks[0]
    assert (decode.token_ids, decode.start_position, decode.samples) == ((1000,), 10, True)


def test_waiting_queue_is_fifo_without_skipping():
    s = _scheduler(num_blocks=4, block_size=4, max_batch_tokens=100)
    s.add(_req(0, 8))  # 2 blocks
    s.add(_req(1, 12))  # 3 blocks: does not fit next to request 0
    s.add(_req(2, 1))  # would fit, but must not jump ahead
    assert _sizes(_step(s)) == [(0, 8)]
    assert s.num_waiting == 2 and s.num_running == 1
    s.finish(0)
    assert _sizes(_step(s)) == [(1, 12), (2, 1)]


def test_max_num_seqs_bounds_chunks_and_running():
    s = _scheduler(max_batch_tokens=100, max_num_seqs=2)
    for i in range(5):
        s.add(_req(i, 2))
    assert [c.request_id for c in _step(s).chunks] == [0, 1]
    assert [c.request_id for c in _step(s).chunks] == [0, 1]
    assert s.num_running == 2 and s.num_waiting == 3
    s.finish(1)
    assert [c.request_id for c in _step(s).chunks] == [0, 2]


def test_preemption_takes_latest_admitted_and_recomputes():
    s = _scheduler(num_blocks=4, block_size=2, max_batch_tokens=100)
    requests = [_req(i, 2, max_tokens=50, first_token=10 * i) for i in range(3)]
    for request in requests:
        s.add(request)
    assert _sizes(_step(s)) == [(0, 2), (1, 2), (2, 2)]  # 3 blocks, 1 free
    # Request 0 takes the free block; request 1 needs one more: the latest admitted (2) goes.
    assert _sizes(_step(s)) == [(0, 1), (1, 1)]
    victim = requests[2]
    assert victim.status is RequestStatus.WAITING and victim.block_ids == []
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert victim.output_token_ids == [1002]
    assert s.num_preemptions == 1 and s.num_waiting == 1
    assert _sizes(_step(s)) == [(0, 1), (1, 1)]  # no block for request 2 yet
    # Request 0 needs a third block: request 1 goes, ahead of request 2 (admitted earlier).
    assert _sizes(_step(s)) == [(0, 1)]
    assert s.num_preemptions == 2 and requests[1].num_preemptions == 1
    assert requests[1].output_token_ids == [1001, 1001, 1001]
    s.finish(0)
    # Request 1 needs 3 blocks for prompt + outputs, so request 2 (2 blocks) waits behind it.
    (recompute,) = _step(s).chunks
    assert recompute.request_id == 1 and recompute.start_position == 0 and recompute.samples
    assert recompute.token_ids == (10, 11, 1001, 1001, 1001)
    s.finish(1)
    (recompute,) = _step(s).chunks
    assert recompute.request_id == 2 and recompute.start_position == 0
    assert recompute.token_ids == (20, 21, 1002)


def test_last_request_preempts_itself_and_admits_nothing():
    s = _scheduler(num_blocks=3, block_size=2, max_batch_tokens=3)
    first, last = _req(0, 2, max_tokens=50), _req(1, 1, max_tokens=50)
    s.add(first)
    s.add(last)
    assert _sizes(_step(s)) == [(0, 2), (1, 1)]
    assert _sizes(_step(s)) == [(0, 1), (1, 1)]  # request 0 takes the last free block
    # Request 1 needs a second block and is itself the latest admitted: it preempts itself.
    # Its freed block and the 2 tokens of budget left would admit a chunk of it again, but a step
    # that preempted admits nothing.
    assert _sizes(_step(s)) == [(0, 1)]
    assert last.status is RequestStatus.WAITING and last.num_preemptions == 1
    assert s.num_preemptions == 1 and s.num_running == 1


def test_finish_between_schedule_and_update_is_ignored_by_update():
    s = _scheduler()
    a, b = _req(0, 5), _req(1, 5)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.finish(0)
    assert a.status is RequestStatus.FINISHED and a.block_ids == []
    s.update(batch, {0: 7, 1: 8})
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert b.output_token_ids == [8] and b.num_computed_tokens == 5
    s.finish(0)  # idempotent
    s.finish(12345)  # unknown
    s.finish(1)
    assert s.num_running == 0 and s.block_manager.num_used_blocks == 0
    assert s.schedule() is None


def test_finish_waiting_request():
    s = _scheduler(max_batch_tokens=4)
    s.add(_req(0, 4))
    waiting = _req(1, 4)
    s.add(waiting)
    s.finish(1)
    assert waiting.status is RequestStatus.FINISHED and s.num_waiting == 1
    assert [c.request_id for c in _step(s).chunks] == [0]


def test_update_twice_is_refused():
    s = _scheduler()
    s.add(_req(0, 3))
    batch = _step(s)
    with pytest.raises(RuntimeError):
        s.update(batch, {})


def test_sample_for_a_mid_prefill_chunk_is_refused():
    s = _scheduler(max_batch_tokens=2)
    s.add(_req(0, 5))
    batch = s.schedule()
    with pytest.raises(ValueError):
        s.update(batch, {0: 1})


def test_can_ever_fit():
    s = _scheduler(num_blocks=4, block_size=4)
    assert s.can_ever_fit(16)
    assert not s.can_ever_fit(17)


def test_prefix_cache_skips_computed_blocks_but_computes_the_last_token():
    s = _scheduler(block_size=4, caching=True)
    s.add(_req(0, 8, max_tokens=1))
    _step(s)
    s.finish(0)
    longer = _req(1, 10)
    s.add(longer)
    chunk = _step(s).chunks[0]
    assert chunk.start_position == 8 and chunk.token_ids == (8, 9)
    # The whole prompt is cached: only the blocks before its last token are reused, so the
    # step still computes (and samples from) the last token and never writes a shared block.
    same = _req(2, 8)
    s.add(same)
    decode, chunk = _step(s).chunks
    assert decode.request_id == 1 and chunk.request_id == 2
    assert chunk.start_position == 4 and chunk.token_ids == (4, 5, 6, 7) and chunk.samples
    assert same.block_ids[0] == longer.block_ids[0] and same.block_ids[1] != longer.block_ids[1]
    assert s.block_manager.ref_count(same.block_ids[0]) == 2
    assert same.num_computed_tokens == 8 and same.output_token_ids == [1002]


def test_blocks_filled_by_decoding_are_cached():
    s = _scheduler(block_size=4, caching=True)
    s.add(_req(0, 3))
    _step(s)  # the prompt: no full block yet
    _step(s)  # the first output token fills block 0
    s.finish(0)
    s.add(GenerationRequest(request_id=1, prompt_token_ids=[0, 1, 2, 1000, 7], max_tokens=1))
    chunk = _step(s).chunks[0]
    assert chunk.start_position == 4 and chunk.token_ids == (7,)


def test_generation_scheduler_imports_no_torch():
    code = "import sys, embedserv.scheduler.generation; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- random workload ---------------------------------------------------------------------------

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

    def run(self, batch: GenerationBatch, requests: dict[int, GenerationRequest]) -> dict[int, int]:
        size = self.block_manager.block_size
        sampled = {}
        for chunk in batch.chunks:
            tokens = requests[chunk.request_id].all_token_ids()
            fingerprints = _fingerprints(tokens)
            end = chunk.start_position + len(chunk.token_ids)
            assert chunk.token_ids == tuple(tokens[chunk.start_position : end])
            for pos in range(chunk.start_position):
                assert self.kv[chunk.block_ids[pos // size]].get(pos % size) == fingerprints[pos], "stale KV"
            for pos in range(chunk.start_position, end):
                block = chunk.block_ids[pos // size]
                assert self.block_manager.ref_count(block) == 1, "writing into a shared block"
                self.kv[block][pos % size] = fingerprints[pos]
            if chunk.samples:
                sampled[chunk.request_id] = self.rng.randrange(VOCAB)
        return sampled


def _check_tables(
    s: GenerationScheduler, live: list[GenerationRequest], batch: GenerationBatch | None
) -> None:
    bm = s.block_manager
    bm.check_invariants()
    scheduled = {c.request_id: len(c.token_ids) for c in batch.chunks} if batch else {}
    owners: dict[int, int] = defaultdict(int)
    for request in live:
        if request.status is RequestStatus.WAITING:
            assert request.block_ids == [] and request.num_computed_tokens == 0
            continue
        assert request.status is RequestStatus.RUNNING
        covered = request.num_computed_tokens + scheduled.get(request.request_id, 0)
        assert len(request.block_ids) == bm.blocks_needed(covered)
        for block in request.block_ids:
            owners[block] += 1
    for block, count in owners.items():
        assert bm.ref_count(block) == count
        assert count == 1 or bm.is_cached(block), "shared block that is not a cached prefix block"
    assert sum(bm.ref_count(b) for b in range(bm.num_blocks)) == sum(owners.values())
    assert s.num_running <= s.max_num_seqs
    assert s.num_running + s.num_waiting == len(live)


def _check_batch(
    s: GenerationScheduler, batch: GenerationBatch, requests: dict[int, GenerationRequest]
) -> None:
    assert batch.num_tokens <= s.max_batch_tokens and batch.num_sequences <= s.max_num_seqs
    assert len({c.request_id for c in batch.chunks}) == batch.num_sequences
    for chunk in batch.chunks:
        request = requests[chunk.request_id]
        assert request.status is RequestStatus.RUNNING and len(chunk.token_ids) > 0
        assert chunk.start_position == request.num_computed_tokens
        assert chunk.block_ids == tuple(request.block_ids)
        assert chunk.samples == (chunk.start_position + len(chunk.token_ids) == request.num_tokens)


class _Workload:
    def __init__(self, seed: int, num_blocks: int, block_size: int, caching: bool) -> None:
        self.rng = random.Random(seed)
        budget, max_num_seqs = self.rng.choice([8, 16, 32]), self.rng.choice([3, 4, 8])
        self.s = _scheduler(num_blocks, block_size, budget, max_num_seqs, caching)
        self.runner = _FakeRunner(self.s.block_manager, self.rng)
        num_prefixes, longest = (3, 3 * block_size) if caching else (1, 0)
        # Prompts start with one of a few shared prefixes so the prefix cache gets hits.
        self.prefixes = [self._random_tokens(0, longest) for _ in range(num_prefixes)]
        self.requests: dict[int, GenerationRequest] = {}
        self.live: list[GenerationRequest] = []
        self.cancelled: set[int] = set()
        self.cache_hits = 0

    def _random_tokens(self, min_len: int, max_len: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(min_len, max_len))]

    def arrive(self) -> None:
        prompt = self.rng.choice(self.prefixes) + self._random_tokens(1, 12)
        max_tokens = self.rng.randint(1, 12)
        if not self.s.can_ever_fit(len(prompt) + max_tokens):
            return  # the engine refuses it
        request = GenerationRequest(len(self.requests), prompt, max_tokens)
        self.requests[request.request_id] = request
        self.live.append(request)
        self.s.add(request)

    def finish(self, request: GenerationRequest, cancelled: bool) -> None:
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
        admitted = [c for c in batch.chunks if c.request_id not in was_running]
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
        assert self.s.block_manager.num_used_blocks == 0
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
