"""The prefill-only scheduler: FIFO, token and sequence budgets, cancellation. No torch here."""

import random
import sys

from embedserv.scheduler.prefill_only import PrefillOnlyScheduler
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind


def _req(i: int, n: int) -> Request:
    return Request(request_id=i, prompt_token_ids=list(range(n)), output=OutputKind.POOL)


def test_packs_fifo_under_token_budget():
    s = PrefillOnlyScheduler(max_batch_tokens=10, max_batch_requests=100)
    for i, n in enumerate([4, 4, 4, 1]):
        s.add(_req(i, n))
    first = s.schedule()
    assert [q.request_id for q in first.sequences] == [0, 1]
    assert first.num_tokens == 8
    # FIFO: the 1-token request does not jump ahead of the 4-token one that did not fit.
    assert [q.request_id for q in s.schedule().sequences] == [2, 3]
    assert s.schedule() is None


def test_sequence_budget():
    s = PrefillOnlyScheduler(max_batch_tokens=1000, max_batch_requests=3)
    for i in range(7):
        s.add(_req(i, 2))
    sizes = []
    while (batch := s.schedule()) is not None:
        sizes.append(batch.num_sequences)
    assert sizes == [3, 3, 1]


def test_oversized_request_runs_alone():
    s = PrefillOnlyScheduler(max_batch_tokens=5, max_batch_requests=10)
    s.add(_req(0, 9))
    s.add(_req(1, 2))
    assert [q.request_id for q in s.schedule().sequences] == [0]
    assert [q.request_id for q in s.schedule().sequences] == [1]


def test_cancelled_requests_never_scheduled():
    s = PrefillOnlyScheduler(max_batch_tokens=100, max_batch_requests=100)
    reqs = [_req(i, 3) for i in range(5)]
    for r in reqs:
        s.add(r)
    reqs[1].cancelled = True
    reqs[3].cancelled = True
    batch = s.schedule()
    assert [q.request_id for q in batch.sequences] == [0, 2, 4]
    assert s.num_waiting == 0


def test_random_workload_conserves_requests():
    rng = random.Random(0)
    s = PrefillOnlyScheduler(max_batch_tokens=64, max_batch_requests=8)
    added, cancelled, seen = set(), set(), []
    next_id = 0
    for _ in range(2000):
        if rng.random() < 0.6:
            r = _req(next_id, rng.randint(1, 80))
            if rng.random() < 0.1:
                r.cancelled = True
                cancelled.add(next_id)
            s.add(r)
            added.add(next_id)
            next_id += 1
        else:
            batch = s.schedule()
            if batch is not None:
                assert batch.num_sequences <= 8
                assert batch.num_tokens <= 64 or batch.num_sequences == 1
                seen.extend(q.request_id for q in batch.sequences)
    while (batch := s.schedule()) is not None:
        seen.extend(q.request_id for q in batch.sequences)
    assert seen == sorted(seen), "FIFO order"
    assert set(seen) == added - cancelled
    assert len(seen) == len(set(seen))


def test_scheduler_imports_no_torch():
    import subprocess

    code = "import sys, embedserv.scheduler.prefill_only; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
