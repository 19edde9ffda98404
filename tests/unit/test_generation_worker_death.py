"""GenerationLoop with a fake worker that dies: its streams fail with NotReady, the loop starts over on the next
incarnation with a fresh KV cache, and the counters survive the reset."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from embedserv.engine.generation import GenerationLoop
from embedserv.engine.types import SamplingParams
from embedserv.errors import NotReady
from embedserv.executor.base import WorkerDied, WorkerStats
from tests.helpers.aio import run_async

TIMEOUT = 5.0
TOKEN = 5


class FakeDetokenizer:
    """What GenerationLoop calls on an IncrementalDetokenizer: add, flush, stopped."""

    stopped = False

    def add(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


class FakeWorker:
    """Each run_generation call takes the next behaviour (default ok): ok samples TOKEN for every sampling chunk;
    die marks the worker down and raises WorkerDied; down_after returns the step's tokens, then goes down
    (the process died between steps)."""

    index = 0

    def __init__(self, num_kv_blocks: int, behaviours=()) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.incarnation = 1
        self.on_change = lambda: None
        self.behaviours = list(behaviours)
        self.steps = 0
        self._ready = asyncio.Event()
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def stats(self) -> WorkerStats:
        return WorkerStats(self.index, 0, self.ready, self.incarnation - 1, self.steps, 0.0)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def run_prefill(self, batch):
        raise AssertionError("no prefill-only work here")

    def go_down(self) -> None:
        self._ready.clear()
        self.on_change()

    def restart(self, num_kv_blocks: int) -> None:
        self.incarnation += 1
        self.num_kv_blocks = num_kv_blocks
        self._ready.set()
        self.on_change()

    async def run_generation(self, batch, sampling):
        assert self.ready, "a step was sent to a worker that is down"
        self.steps += 1
        await asyncio.sleep(0)
        behaviour = self.behaviours.pop(0) if self.behaviours else "ok"
        if behaviour == "die":
            self.go_down()
            raise WorkerDied("worker 0 died while running the batch", sent=True)
        sampled = {chunk.request_id: TOKEN for chunk in batch.chunks if chunk.samples}
        if behaviour == "down_after":
            self.go_down()
        return sampled


@pytest.fixture()
def pool():
    executor = ThreadPoolExecutor(1)
    yield executor
    executor.shutdown(wait=True)


def make_loop(pool, worker, block_size: int = 2) -> GenerationLoop:
    spec = SimpleNamespace(eos_token_ids=frozenset({2}), max_model_len=100)
    loop = GenerationLoop("m", spec, worker, pool, block_size, 64, 8, False)
    worker.on_change = loop.workers_changed
    loop.start()
    return loop


async def collect(loop, tokens, max_tokens: int, deltas: list | None = None, timeout: float = TIMEOUT) -> list:
    deltas = [] if deltas is None else deltas

    async def go():
        async for delta in loop.stream(list(tokens), FakeDetokenizer(), SamplingParams(max_tokens=max_tokens)):
            deltas.append(delta)

    await asyncio.wait_for(go(), timeout)
    return deltas


async def until(condition) -> None:
    async def go():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(go(), TIMEOUT)


def assert_complete(deltas, max_tokens: int, prompt_tokens: int) -> None:
    assert [d.token_ids for d in deltas] == [(TOKEN,)] * max_tokens
    assert [d.finish_reason for d in deltas] == [None] * (max_tokens - 1) + ["length"]
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (prompt_tokens, max_tokens)


@run_async
async def test_streams_run_on_a_live_worker(pool):
    loop = make_loop(pool, FakeWorker(16))
    assert loop.is_accepting
    assert_complete(await collect(loop, [1, 1, 1], 4), 4, 3)
    assert loop.num_streams == 0 and loop.kv_cache_usage().used_blocks == 0
    await loop.stop()


@run_async
async def test_death_mid_stream_fails_its_streams_then_the_loop_resets(pool):
    worker = FakeWorker(16, ["ok", "ok", "die"])
    loop = make_loop(pool, worker)
    old_manager = loop.block_manager
    got = [[], []]
    outcomes = await asyncio.gather(
        collect(loop, [1, 1, 1], 10, got[0]), collect(loop, [3, 4], 10, got[1]), return_exceptions=True
    )
    for outcome, deltas in zip(outcomes, got):
        assert isinstance(outcome, NotReady), outcome
        assert "retry the call" in str(outcome)
        assert [d.token_ids for d in deltas] == [(TOKEN,), (TOKEN,)]
        assert all(d.finish_reason is None for d in deltas)
    assert loop.num_streams == 0
    assert old_manager.num_used_blocks == 0

    # Down: not accepting, new streams refused at once, nothing sent to the worker.
    assert loop.is_running and not loop.is_accepting
    with pytest.raises(NotReady, match="not running"):
        await collect(loop, [1], 2)
    steps = worker.steps
    await asyncio.sleep(0.01)
    assert worker.steps == steps
    assert loop.block_manager is old_manager

    # The next incarnation, with a different KV cache size: a fresh block manager.
    worker.restart(num_kv_blocks=8)
    await until(lambda: loop.is_accepting)
    assert loop.block_manager is not old_manager
    assert loop.block_manager.num_blocks == 8
    usage = loop.kv_cache_usage()
    assert (usage.total_blocks, usage.used_blocks, usage.block_size) == (8, 0, 2)
    assert_complete(await collect(loop, [1, 1, 1], 5), 5, 3)
    await loop.stop()


@run_async
async def test_a_loop_started_before_its_worker_is_ready_waits_for_it(pool):
    worker = FakeWorker(6)
    worker._ready.clear()
    worker.incarnation = 0
    loop = make_loop(pool, worker)
    assert loop.is_running and not loop.is_accepting and loop.block_manager is None
    assert loop.kv_cache_usage().total_blocks == 0
    with pytest.raises(NotReady):
        await collect(loop, [1], 2)
    worker.restart(num_kv_blocks=6)
    await until(lambda: loop.is_accepting)
    assert loop.block_manager.num_blocks == 6
    assert_complete(await collect(loop, [1, 2], 3), 3, 2)
    await loop.stop()


@run_async
async def test_preemptions_are_counted_across_a_reset(pool):
    # 4 blocks of 2 tokens: two 3-token prompts fill the cache; growing to 5 tokens preempts one.
    worker = FakeWorker(4)
    loop = make_loop(pool, worker, block_size=2)
    results = await asyncio.gather(collect(loop, [1, 1, 1], 4), collect(loop, [1, 1, 1], 4))
    for deltas in results:
        assert_complete(deltas, 4, 3)
    preemptions = loop.kv_cache_usage().preemptions
    assert preemptions == 1

    worker.behaviours = ["die"]
    with pytest.raises(NotReady):
        await collect(loop, [1], 3)
    worker.restart(num_kv_blocks=8)
    await until(lambda: loop.is_accepting)
    assert loop.scheduler.num_preemptions == 0
    usage = loop.kv_cache_usage()
    assert (usage.preemptions, usage.total_blocks, usage.used_blocks) == (preemptions, 8, 0)
    assert_complete(await collect(loop, [1, 1, 1], 4), 4, 3)
    assert loop.kv_cache_usage().preemptions == preemptions
    await loop.stop()


@run_async
async def test_stop_ends_streams_waiting_for_a_dead_worker(pool):
    worker = FakeWorker(16, ["die"])
    loop = make_loop(pool, worker)
    with pytest.raises(NotReady):
        await collect(loop, [1], 3)
    await asyncio.wait_for(loop.stop(), TIMEOUT)
    assert not loop.is_running and not loop.is_accepting


@run_async
async def test_death_between_steps_fails_streams_without_waiting_for_the_restart(pool):
    worker = FakeWorker(16, ["down_after"])
    loop = make_loop(pool, worker)
    deltas = []
    try:
        with pytest.raises(NotReady):
            # The worker stays down: the stream must end now, not when (if) a replacement is ready.
            await collect(loop, [1, 1, 1], 5, deltas, timeout=0.5)
        # The step's token may or may not reach the stream first: the death fails it as soon as it is seen.
        assert [d.token_ids for d in deltas] in ([], [(TOKEN,)])
        assert worker.steps == 1 and loop.num_streams == 0
    finally:
        await loop.stop()


class GatedWorker(FakeWorker):
    """Each step waits for `gate`: streams added meanwhile wait for the next step."""

    def __init__(self, num_kv_blocks: int) -> None:
        super().__init__(num_kv_blocks)
        self.gate = asyncio.Event()
        self.computed: set[int] = set()

    async def run_generation(self, batch, sampling):
        await self.gate.wait()
        self.computed.update(chunk.request_id for chunk in batch.chunks)
        return await super().run_generation(batch, sampling)


@run_async
async def test_a_stream_cancelled_before_its_first_step_is_dropped_and_counted(pool):
    worker = GatedWorker(16)
    loop = make_loop(pool, worker)
    running = asyncio.create_task(collect(loop, [1, 1, 1], 3))
    await until(lambda: worker.steps == 0 and loop.scheduler.num_running == 1)
    queued = asyncio.create_task(collect(loop, [1, 1], 3))
    await until(lambda: loop.num_waiting == 1)
    queued.cancel()  # the client went away while its stream waited
    await asyncio.gather(queued, return_exceptions=True)
    assert (loop.num_dropped, loop.num_waiting) == (1, 0)

    worker.gate.set()
    assert_complete(await running, 3, 3)
    assert len(worker.computed) == 1, "the dropped stream never joined a step"
    # A stream cancelled after it ran is not a dropped one.
    worker.gate.clear()
    started = asyncio.create_task(collect(loop, [1, 1, 1], 3))
    await until(lambda: loop.scheduler.num_running == 1)
    started.cancel()
    await asyncio.gather(started, return_exceptions=True)
    assert loop.num_dropped == 1
    worker.gate.set()
    await loop.stop()
