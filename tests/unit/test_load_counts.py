"""The load metrics' counting (engine/core/dispatch.py, scheduler/prefill_only.py): the busy ratio's sliding
window on a fake clock, calls moving from waiting to running to done, and the schedulers' waiting tokens. No
server."""

import pytest

from embedserv.engine.core.dispatch import BusyWindow
from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
from embedserv.scheduler.prefill_only import CallCounts, PrefillOnlyScheduler
from embedserv.scheduler.request import Request
from embedserv.steps import OutputKind
from embedserv.types import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _window(window_s: float = 10.0) -> tuple[BusyWindow, FakeClock]:
    clock = FakeClock()
    return BusyWindow(window_s, clock), clock


def test_idle_worker_reads_zero_and_a_fresh_window_reads_zero():
    window, clock = _window()
    assert window.ratio() == 0.0
    clock.now += 30
    assert window.ratio() == 0.0


def test_an_open_busy_period_counts_before_it_ends():
    window, clock = _window()
    clock.now += 20
    window.begin()
    clock.now += 5
    assert window.ratio() == pytest.approx(0.5)
    clock.now += 10
    assert window.ratio() == pytest.approx(1.0)


def test_finished_periods_count_their_overlap_with_the_window_then_leave_it():
    window, clock = _window()
    clock.now += 20
    window.begin()
    clock.now += 4
    window.end()  # busy 20..24
    clock.now += 2
    window.begin()
    clock.now += 2
    window.end()  # busy 26..28
    clock.now += 2  # now 30: window 20..30 holds 6 s busy
    assert window.ratio() == pytest.approx(0.6)
    clock.now += 3  # window 23..33: 1 s of the first period, 2 of the second
    assert window.ratio() == pytest.approx(0.3)
    clock.now += 20
    assert window.ratio() == 0.0


def test_before_a_whole_window_has_passed_the_ratio_is_over_the_time_since_start():
    window, clock = _window()
    window.begin()
    clock.now += 2
    window.end()
    clock.now += 2
    assert window.ratio() == pytest.approx(0.5)


def test_nested_begin_and_stray_end_change_nothing():
    window, clock = _window()
    clock.now += 10
    window.end()
    window.begin()
    clock.now += 2
    window.begin()  # a second step while the first is in flight: still one period
    clock.now += 3
    window.end()
    clock.now += 5
    assert window.ratio() == pytest.approx(0.5)


def test_old_periods_are_dropped_as_new_ones_end():
    window, clock = _window()
    for _ in range(1000):
        window.begin()
        clock.now += 0.5
        window.end()
        clock.now += 0.5
    assert len(window._records) <= 11
    assert window.ratio() == pytest.approx(0.5, abs=0.06)


def test_many_short_steps_keep_a_hundred_records_and_the_ratio_within_one_percent():
    window, clock = _window()
    for _ in range(20000):  # 20 s of 1 ms steps, 3 ms apart
        window.begin()
        clock.now += 0.001
        window.end()
        clock.now += 0.002
    assert len(window._records) <= 102
    assert window.ratio() == pytest.approx(1 / 3, abs=0.01)
    window.begin()  # a long step: the window fills with it
    clock.now += 4
    assert window.ratio() == pytest.approx(0.4 + 0.6 / 3, abs=0.01)


def test_a_call_is_waiting_then_running_then_gone():
    counts = CallCounts()
    first, second = counts.admit(), counts.admit()
    assert (counts.waiting, counts.running) == (2, 0)
    first.start()
    first.start()
    assert (counts.waiting, counts.running) == (1, 1)
    first.done()
    second.done()  # cancelled before it ran
    second.start()  # a late sequence of a finished call counts nothing
    first.done()
    assert (counts.waiting, counts.running) == (0, 0)


def _prefill(i: int, n: int, call=None) -> Request:
    return Request(request_id=i, prompt_token_ids=list(range(n)), output=OutputKind.POOL, call=call)


def test_prefill_waiting_tokens_follow_the_queue_and_batches_start_calls():
    counts = CallCounts()
    call = counts.admit()
    s = PrefillOnlyScheduler(max_batch_tokens=8, max_batch_requests=100)
    requests = [_prefill(0, 5, call), _prefill(1, 5, call), _prefill(2, 3)]
    for request in requests:
        s.add(request)
    assert s.waiting_tokens == 13
    s.schedule()
    assert s.waiting_tokens == 8
    assert (counts.waiting, counts.running) == (0, 1)
    s.requeue([requests[0]])
    assert s.waiting_tokens == 13
    s.cancel(requests[1])  # its caller went away: its tokens stop counting before a batch drops it
    s.cancel(requests[1])
    assert s.waiting_tokens == 8
    s.schedule()  # picks 0, drops the cancelled 1, then 2 fits
    assert s.waiting_tokens == 0
    s.cancel(requests[0])  # already in a batch: nothing was waiting
    assert s.waiting_tokens == 0
    drained = _prefill(3, 4)
    s.add(drained)
    s.drain()
    s.cancel(drained)  # its call then fails: the tokens left with the drain
    assert s.waiting_tokens == 0


def test_encoder_decoder_sequences_wait_with_both_their_token_counts():
    s = PrefillOnlyScheduler(max_batch_tokens=8, max_batch_requests=100)
    s.add(Request(0, [1], OutputKind.SCORE, encoder_token_ids=[5, 6, 7]))
    assert s.waiting_tokens == 4


def test_generation_waiting_tokens_are_the_waiting_prompts():
    kv_cache = KvCacheManager([KvGroup(4)], 64, enable_prefix_caching=False)
    s = GenerationScheduler(kv_cache, max_batch_tokens=64, max_num_seqs=1)
    for i, n in enumerate([6, 9]):
        s.add(Request(i, list(range(n)), OutputKind.SAMPLE, SamplingParams(max_tokens=4)))
    assert s.waiting_tokens == 15
    s.schedule()  # one sequence at a time: the first is admitted
    assert (s.num_waiting, s.num_running, s.waiting_tokens) == (1, 1, 9)
