"""The generation scheduler: token budget, chunked prefill, FIFO, preemption by recompute, prefix caching.

No torch here. test_generation_scheduler_properties.py drives random workloads through it.
"""

import subprocess
import sys

import pytest

from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
from embedserv.scheduler.request import Request, RequestStatus
from embedserv.steps import OutputKind, StepBatch
from embedserv.types import SamplingParams


def _scheduler(num_blocks=64, block_size=4, max_batch_tokens=64, max_num_seqs=16, caching=False):
    kv_cache = KvCacheManager([KvGroup(block_size)], num_blocks, enable_prefix_caching=caching)
    return GenerationScheduler(kv_cache, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs)


def _gen(request_id: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, OutputKind.SAMPLE, SamplingParams(max_tokens=max_tokens))


def _req(request_id: int, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    return _gen(request_id, list(range(first_token, first_token + prompt_len)), max_tokens)


def _step(s: GenerationScheduler) -> StepBatch:
    """One schedule + update; every sampling chunk gets token 1000 + request_id."""
    batch = s.schedule()
    assert batch is not None
    s.update(batch, {c.request_id: 1000 + c.request_id for c in batch.sequences if c.produces_output})
    return batch


def _sizes(batch: StepBatch) -> list[tuple[int, int]]:
    return [(c.request_id, len(c.token_ids)) for c in batch.sequences]


def test_token_budget_respected_with_chunked_tail():
    s = _scheduler(max_batch_tokens=10)
    for i in range(3):
        s.add(_req(i, 4))
    batch = s.schedule()
    assert _sizes(batch) == [(0, 4), (1, 4), (2, 2)]
    assert batch.num_tokens == 10 and batch.num_sequences == 3
    assert [c.produces_output for c in batch.sequences] == [True, True, False]


def test_decodes_go_before_new_prefills():
    s = _scheduler(max_batch_tokens=8)
    s.add(_req(0, 3))
    s.add(_req(1, 3))
    _step(s)
    s.add(_req(2, 20))
    batch = _step(s)
    assert _sizes(batch) == [(0, 1), (1, 1), (2, 6)]
    assert batch.sequences[0].token_ids == (1000,) and batch.sequences[0].start_position == 3


def test_chunked_prefill_samples_only_on_last_chunk():
    s = _scheduler(block_size=4, max_batch_tokens=4)
    request = _req(0, 10, first_token=100)
    s.add(request)
    chunks = [_step(s).sequences[0] for _ in range(3)]
    assert [c.start_position for c in chunks] == [0, 4, 8]
    assert [c.token_ids for c in chunks] == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert [c.produces_output for c in chunks] == [False, False, True]
    assert [len(c.block_ids[0]) for c in chunks] == [1, 2, 3]
    assert chunks[2].block_ids[0][:2] == chunks[1].block_ids[0]
    assert request.output_token_ids == [1000] and request.num_computed_tokens == 10
    decode = _step(s).sequences[0]
    assert (decode.token_ids, decode.start_position, decode.produces_output) == ((1000,), 10, True)


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
    assert [c.request_id for c in _step(s).sequences] == [0, 1]
    assert [c.request_id for c in _step(s).sequences] == [0, 1]
    assert s.num_running == 2 and s.num_waiting == 3
    s.finish(1)
    assert [c.request_id for c in _step(s).sequences] == [0, 2]


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
    (recompute,) = _step(s).sequences
    assert recompute.request_id == 1 and recompute.start_position == 0 and recompute.produces_output
    assert recompute.token_ids == (10, 11, 1001, 1001, 1001)
    s.finish(1)
    (recompute,) = _step(s).sequences
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
    assert s.num_running == 0 and s.kv_cache.num_used_blocks == 0
    assert s.schedule() is None


def test_finish_waiting_request():
    s = _scheduler(max_batch_tokens=4)
    s.add(_req(0, 4))
    waiting = _req(1, 4)
    s.add(waiting)
    s.finish(1)
    assert waiting.status is RequestStatus.FINISHED and s.num_waiting == 1
    assert [c.request_id for c in _step(s).sequences] == [0]


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
    assert s.can_ever_fit(_req(0, 1), 16)
    assert not s.can_ever_fit(_req(0, 1), 17)


def test_prefix_cache_skips_computed_blocks_but_computes_the_last_token():
    s = _scheduler(block_size=4, caching=True)
    s.add(_req(0, 8, max_tokens=1))
    _step(s)
    s.finish(0)
    longer = _req(1, 10)
    s.add(longer)
    chunk = _step(s).sequences[0]
    assert chunk.start_position == 8 and chunk.token_ids == (8, 9)
    # The whole prompt is cached: only the blocks before its last token are reused, so the
    # step still computes (and samples from) the last token and never writes a shared block.
    same = _req(2, 8)
    s.add(same)
    decode, chunk = _step(s).sequences
    assert decode.request_id == 1 and chunk.request_id == 2
    assert chunk.start_position == 4 and chunk.token_ids == (4, 5, 6, 7) and chunk.produces_output
    assert same.block_ids[0][0] == longer.block_ids[0][0] and same.block_ids[0][1] != longer.block_ids[0][1]
    assert s.kv_cache.managers[0].ref_count(same.block_ids[0][0]) == 2
    assert same.num_computed_tokens == 8 and same.output_token_ids == [1002]


def test_blocks_filled_by_decoding_are_cached():
    s = _scheduler(block_size=4, caching=True)
    s.add(_req(0, 3))
    _step(s)  # the prompt: no full block yet
    _step(s)  # the first output token fills block 0
    s.finish(0)
    s.add(_gen(1, [0, 1, 2, 1000, 7], 1))
    chunk = _step(s).sequences[0]
    assert chunk.start_position == 4 and chunk.token_ids == (7,)


def test_generation_scheduler_imports_no_torch():
    code = "import sys, embedserv.scheduler.generation; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
