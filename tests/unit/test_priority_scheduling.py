"""Priority, aging, tenants' turns and the short steps under priority, in both schedulers, on a fake clock."""

from __future__ import annotations

import random

from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
from embedserv.scheduler.prefill_only import PRIORITY_WINDOW_S, PrefillOnlyScheduler
from embedserv.scheduler.request import Request
from embedserv.scheduler.waiting import WaitingQueue
from embedserv.steps import OutputKind
from embedserv.types import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _req(i: int, n: int = 2, priority: int = 0, tenant: str = "") -> Request:
    return Request(i, list(range(n)), OutputKind.POOL, priority=priority, tenant=tenant)


def _order(queue: WaitingQueue) -> list[int]:
    out = []
    while (request := queue.first()) is not None:
        queue.pop(request)
        out.append(request.request_id)
    return out


def _ids(batch) -> list[int]:
    return [sequence.request_id for sequence in batch.sequences]


def test_higher_priority_first_fifo_within_one():
    queue = WaitingQueue()
    for i, priority in enumerate([0, 5, 0, 5, -1, 10]):
        queue.append(_req(i, priority=priority))
    assert _order(queue) == [5, 1, 3, 0, 2, 4]
    assert len(queue) == 0


def test_tenants_take_turns_within_a_priority():
    queue = WaitingQueue()
    # Tenant a's burst of four came first; b's two sequences do not wait behind all of it.
    for i in range(4):
        queue.append(_req(i, tenant="a"))
    queue.append(_req(10, tenant="b"))
    queue.append(_req(11, tenant="b"))
    assert _order(queue) == [0, 10, 1, 11, 2, 3]


def test_aging_bounds_a_low_priority_wait():
    clock = Clock()
    queue = WaitingQueue(max_wait_s=30.0, clock=clock)
    queue.append(_req(0, priority=-1))
    clock.now += 10
    for i in range(1, 4):
        queue.append(_req(i, priority=5))
    assert queue.first().request_id == 1
    clock.now += 19.9
    assert queue.first().request_id == 1
    clock.now += 0.1  # request 0 has now waited 30 s: it goes before any priority
    assert _order(queue) == [0, 1, 2, 3]


def test_without_aging_priority_is_strict():
    clock = Clock()
    queue = WaitingQueue(clock=clock)
    queue.append(_req(0, priority=-1))
    clock.now += 1e6
    queue.append(_req(1, priority=0))
    assert _order(queue) == [1, 0]


def test_put_back_goes_first_of_its_priority_and_keeps_its_arrival():
    clock = Clock()
    queue = WaitingQueue(clock=clock)
    first = _req(0, tenant="a")
    queue.append(first)
    queue.pop(queue.first())
    clock.now += 5
    queue.append(_req(1, tenant="b"))
    queue.append(_req(2, priority=3))
    queue.appendleft(first)
    assert first.arrival == 100.0
    assert _order(queue) == [2, 0, 1]


def test_remove_and_counts():
    queue = WaitingQueue()
    requests = [_req(i, priority=i % 2, tenant="ab"[i % 2]) for i in range(5)]
    for request in requests:
        queue.append(request)
    assert queue.counts() == {(0, "a"): 3, (1, "b"): 2}
    queue.remove(requests[1])
    queue.remove(requests[3])
    assert queue.counts() == {(0, "a"): 3}
    assert queue.top_priority() == 0
    assert sorted(r.request_id for r in queue) == [0, 2, 4]
    assert [r.request_id for r in queue.clear()] == [0, 2, 4]
    assert queue.top_priority() is None and len(queue) == 0


def test_random_operations_lose_nothing():
    rng = random.Random(7)
    clock = Clock()
    queue = WaitingQueue(max_wait_s=3.0, clock=clock)
    inside: set[int] = set()
    popped: list[int] = []
    for i in range(2000):
        clock.now += rng.random()
        action = rng.random()
        if action < 0.55:
            queue.append(_req(i, priority=rng.choice([-1, 0, 2]), tenant=rng.choice("xyz")))
            inside.add(i)
        elif action < 0.9 and len(queue):
            request = queue.first()
            queue.pop(request)
            popped.append(request.request_id)
            inside.discard(request.request_id)
        elif inside:
            victim = next(r for r in queue if r.request_id == min(inside))
            queue.remove(victim)
            inside.discard(victim.request_id)
        assert len(queue) == len(inside) == sum(queue.counts().values())
        assert {r.request_id for r in queue} == inside
    assert len(popped) == len(set(popped))


def test_prefill_takes_priority_before_an_earlier_bulk_call():
    s = PrefillOnlyScheduler(max_batch_tokens=8, max_batch_requests=100, clock=Clock())
    for i in range(8):
        s.add(_req(i, n=4))
    s.add(_req(100, n=4, priority=1))
    # It fills up with bulk (no short budget asked for).
    assert _ids(s.schedule()) == [100, 0]
    assert s.num_waiting == 7


def test_bulk_steps_are_short_while_higher_priority_calls_come():
    clock = Clock()
    s = PrefillOnlyScheduler(max_batch_tokens=64, max_batch_requests=100, priority_batch_tokens=8, clock=clock)
    for i in range(32):
        s.add(_req(i, n=4))
    # Only bulk has come: full steps.
    assert len(_ids(s.schedule())) == 16
    s.add(_req(100, n=4, priority=1))
    # The query runs first, with as much bulk as fits the short budget; then bulk runs in short steps.
    assert _ids(s.schedule()) == [100, 16]
    assert len(_ids(s.schedule())) == 2
    # Once no higher-priority call has come for the window, bulk steps are full again.
    clock.now += PRIORITY_WINDOW_S + 0.1
    assert len(_ids(s.schedule())) == 13


def test_prefill_tokens_and_cancels_still_counted():
    s = PrefillOnlyScheduler(max_batch_tokens=100, max_batch_requests=100, clock=Clock())
    requests = [_req(i, n=3, priority=i % 3) for i in range(6)]
    for request in requests:
        s.add(request)
    s.cancel(requests[2])
    assert s.waiting_tokens == 15
    assert sorted(_ids(s.schedule())) == [0, 1, 3, 4, 5]
    assert s.num_dropped == 1 and s.waiting_tokens == 0 and s.num_waiting == 0


def test_generation_admits_higher_priority_first_and_never_preempts_for_it():
    kv = KvCacheManager([KvGroup(4)], num_blocks=64)
    s = GenerationScheduler(kv, max_batch_tokens=16, max_num_seqs=1)
    sampling = SamplingParams(max_tokens=4)
    running = Request(0, [1, 2, 3], OutputKind.SAMPLE, sampling=sampling)
    s.add(running)
    s.schedule()
    s.add(Request(1, [1, 2], OutputKind.SAMPLE, sampling=sampling))
    s.add(Request(2, [1, 2], OutputKind.SAMPLE, sampling=sampling, priority=9))
    # The stream that runs keeps its seat; the urgent one waits at the front.
    assert s.num_running == 1 and s.num_waiting == 2
    s.finish(0)
    batch = s.schedule()
    assert [chunk.request_id for chunk in batch.sequences] == [2]


def test_work_below_the_default_priority_always_runs_in_short_steps():
    clock = Clock()
    s = PrefillOnlyScheduler(64, 100, priority_batch_tokens=8, clock=clock, default_priority=0)
    for i in range(8):
        s.add(_req(i, n=4, priority=-1))
    # Background work: short steps even with nothing else queued, so a query arriving any time waits little.
    assert len(_ids(s.schedule())) == 2
    clock.now += PRIORITY_WINDOW_S + 1
    assert len(_ids(s.schedule())) == 2
    s.add(_req(100, n=4))
    assert _ids(s.schedule()) == [100, 4]
