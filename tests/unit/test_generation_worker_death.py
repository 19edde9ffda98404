"""GenerationStreams and its dispatcher with a fake worker that dies: its streams fail with NotReady, the streams
start over on the next incarnation with a fresh KV cache, and the counters survive the reset. Also: a caller that
takes the generation whole, and where a step's text is made (on the loop, or the tokenizer thread)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from embedserv.engine.core.dispatch import Dispatcher
from embedserv.engine.core.generation import GenerationStreams
from embedserv.engine.core.prompts import PreparedPrompt
from embedserv.engine.inputs.tokenizer import TokenizerPool
from embedserv.errors import NotReady
from embedserv.executor.base import WorkerDied, WorkerStats
from embedserv.scheduler.kv_cache_manager import KvCacheLayout, KvGroup
from embedserv.steps import StepBatch, StepOutput
from embedserv.types import SamplingParams
from tests.helpers.aio import run_async

TIMEOUT = 5.0
TOKEN = 5


class FakeDetokenizer:
    """What GenerationStreams calls on an IncrementalDetokenizer: add, flush, stopped; `threads`: where add ran."""

    stopped = False

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def add(self, token_id: int) -> str:
        self.threads.add(threading.current_thread().name)
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


class FakeWorker:
    """Each execute call takes the next behaviour (default ok): ok samples TOKEN for every sequence that produces
    an output; die marks the worker down and raises WorkerDied; down_after returns the step's tokens, then goes
    down (the process died between steps). Its KV cache has one group of `block_size`-token blocks."""

    index = 0

    def __init__(self, num_kv_blocks: int, behaviours=(), block_size: int = 2) -> None:
        self.block_size = block_size
        self.kv_cache = KvCacheLayout(num_kv_blocks, (KvGroup(block_size),))
        self.incarnation = 1
        self.on_change = lambda: None
        self.recycling = False
        self.idle = lambda: True
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

    def go_down(self) -> None:
        self._ready.clear()
        self.on_change()

    def restart(self, num_kv_blocks: int) -> None:
        self.incarnation += 1
        self.kv_cache = KvCacheLayout(num_kv_blocks, (KvGroup(self.block_size),))
        self._ready.set()
        self.on_change()

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        assert self.ready, "a step was sent to a worker that is down"
        assert batch.uses_kv_cache and generation, "no prefill-only work here"
        self.steps += 1
        await asyncio.sleep(0)
        behaviour = self.behaviours.pop(0) if self.behaviours else "ok"
        if behaviour == "die":
            self.go_down()
            raise WorkerDied("worker 0 died while running the batch", sent=True)
        sampled = tuple(s.request_id for s in batch.sequences if s.produces_output)
        output = StepOutput(
            row_request_ids=(),
            rows=np.zeros((0, 0), np.float32),
            sampled_request_ids=sampled,
            tokens=np.full(len(sampled), TOKEN, np.int64),
        )
        if behaviour == "down_after":
            self.go_down()
        return output


@pytest.fixture()
def pool():
    tokenizer_pool = TokenizerPool(1, "test")
    yield tokenizer_pool
    tokenizer_pool.shutdown()


class Loop:
    """The worker's streams and the dispatcher, started and stopped as LocalCore starts and stops them."""

    def __init__(self, dispatcher: Dispatcher, streams: GenerationStreams) -> None:
        self.dispatcher = dispatcher
        self.streams = streams

    @property
    def is_running(self) -> bool:
        return self.dispatcher.is_running

    async def stop(self) -> None:
        await self.dispatcher.stop()
        self.streams.stop()


async def make_loop(pool, worker, max_batch_tokens: int = 64, max_num_seqs: int = 8) -> tuple[GenerationStreams, Loop]:
    """The worker's streams and the dispatcher, wired as LocalCore wires them (no prefill-only work)."""
    streams = GenerationStreams(
        "m", worker, pool, frozenset({2}), 100, max_batch_tokens, max_num_seqs, False, lambda: dispatcher.wake()
    )
    dispatcher = Dispatcher("m", [worker], None, [streams], 1)

    def workers_changed() -> None:
        streams.workers_changed()
        dispatcher.wake()

    worker.on_change = workers_changed
    dispatcher.start()
    streams.start()
    # The dispatcher's first turn: a ready worker's KV cache is taken at its first schedule().
    await asyncio.sleep(0)
    return streams, Loop(dispatcher, streams)


async def collect(
    streams, tokens, max_tokens: int, deltas: list | None = None, timeout: float = TIMEOUT, whole: bool = False
) -> list:
    deltas = [] if deltas is None else deltas

    async def go():
        prompt = PreparedPrompt(list(tokens), FakeDetokenizer())
        async for delta in streams.stream(prompt, SamplingParams(max_tokens=max_tokens), whole=whole):
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
    streams, loop = await make_loop(pool, FakeWorker(16))
    assert streams.is_accepting
    assert_complete(await collect(streams, [1, 1, 1], 4), 4, 3)
    assert streams.num_streams == 0 and streams.kv_cache_usage().used_blocks == 0
    await loop.stop()


@run_async
async def test_a_caller_that_takes_the_generation_whole_gets_one_delta_at_the_end(pool):
    """stream=False (an unstreamed completion): not woken at each step, one delta with every token and the text."""
    streams, loop = await make_loop(pool, FakeWorker(16))
    streamed, whole = await asyncio.gather(collect(streams, [1, 1, 1], 4), collect(streams, [1, 1], 4, whole=True))
    assert_complete(streamed, 4, 3)
    assert len(whole) == 1
    assert whole[0].token_ids == (TOKEN,) * 4 and whole[0].text == f"<{TOKEN}>" * 4
    assert (whole[0].finish_reason, whole[0].prompt_tokens, whole[0].completion_tokens) == ("length", 2, 4)
    assert streams.num_streams == 0 and streams.kv_cache_usage().used_blocks == 0
    await loop.stop()


@run_async
async def test_a_steps_text_is_made_on_the_loop_up_to_128_streams_and_in_the_tokenizer_thread_beyond(pool):
    for count, where in ((128, "MainThread"), (129, "tokenize-test_0")):
        streams, loop = await make_loop(pool, FakeWorker(4 * count, block_size=4), 1024, 256)
        detokenizers = [FakeDetokenizer() for _ in range(count)]

        async def one(streams: GenerationStreams, detokenizer: FakeDetokenizer) -> list:
            prompt = PreparedPrompt([1, 1], detokenizer)
            return [d async for d in streams.stream(prompt, SamplingParams(max_tokens=3))]

        results = await asyncio.wait_for(asyncio.gather(*(one(streams, d) for d in detokenizers)), TIMEOUT)
        for deltas in results:
            assert_complete(deltas, 3, 2)
        # Every stream ran in every step: the whole step's text was made in one place.
        assert {name for d in detokenizers for name in d.threads} == {where}
        await loop.stop()


@run_async
async def test_a_whole_generation_whose_worker_dies_fails_without_its_held_text(pool):
    streams, loop = await make_loop(pool, FakeWorker(16, ["ok", "ok", "die"]))
    deltas: list = []
    with pytest.raises(NotReady):
        await collect(streams, [1, 1, 1], 8, deltas, whole=True)
    assert deltas == []
    await loop.stop()


@run_async
async def test_death_mid_stream_fails_its_streams_then_the_loop_resets(pool):
    worker = FakeWorker(16, ["ok", "ok", "die"])
    streams, loop = await make_loop(pool, worker)
    old_kv_cache = streams.kv_cache
    got = [[], []]
    outcomes = await asyncio.gather(
        collect(streams, [1, 1, 1], 10, got[0]), collect(streams, [3, 4], 10, got[1]), return_exceptions=True
    )
    for outcome, deltas in zip(outcomes, got, strict=True):
        assert isinstance(outcome, NotReady), outcome
        assert "retry the call" in str(outcome)
        assert [d.token_ids for d in deltas] == [(TOKEN,), (TOKEN,)]
        assert all(d.finish_reason is None for d in deltas)
    assert streams.num_streams == 0
    assert old_kv_cache.num_used_blocks == 0

    # Down: not accepting, new streams refused at once, nothing sent to the worker.
    assert loop.is_running and not streams.is_accepting
    with pytest.raises(NotReady, match="not running"):
        await collect(streams, [1], 2)
    steps = worker.steps
    await asyncio.sleep(0.01)
    assert worker.steps == steps
    assert streams.kv_cache is old_kv_cache

    # The next incarnation, with a different KV cache size: a fresh KV cache manager.
    worker.restart(num_kv_blocks=8)
    await until(lambda: streams.is_accepting)
    assert streams.kv_cache is not old_kv_cache
    assert streams.kv_cache.num_blocks == 8
    usage = streams.kv_cache_usage()
    assert (usage.total_blocks, usage.used_blocks, usage.block_size) == (8, 0, 2)
    assert_complete(await collect(streams, [1, 1, 1], 5), 5, 3)
    await loop.stop()


@run_async
async def test_a_loop_started_before_its_worker_is_ready_waits_for_it(pool):
    worker = FakeWorker(6)
    worker._ready.clear()
    worker.incarnation = 0
    worker.kv_cache = None  # a worker reports its KV cache once ready
    streams, loop = await make_loop(pool, worker)
    assert loop.is_running and not streams.is_accepting and streams.kv_cache is None
    assert streams.kv_cache_usage().total_blocks == 0
    with pytest.raises(NotReady):
        await collect(streams, [1], 2)
    worker.restart(num_kv_blocks=6)
    await until(lambda: streams.is_accepting)
    assert streams.kv_cache.num_blocks == 6
    assert_complete(await collect(streams, [1, 2], 3), 3, 2)
    await loop.stop()


@run_async
async def test_preemptions_are_counted_across_a_reset(pool):
    # 4 blocks of 2 tokens: two 3-token prompts fill the cache; growing to 5 tokens preempts one.
    worker = FakeWorker(4, block_size=2)
    streams, loop = await make_loop(pool, worker)
    results = await asyncio.gather(collect(streams, [1, 1, 1], 4), collect(streams, [1, 1, 1], 4))
    for deltas in results:
        assert_complete(deltas, 4, 3)
    preemptions = streams.kv_cache_usage().preemptions
    assert preemptions == 1

    worker.behaviours = ["die"]
    with pytest.raises(NotReady):
        await collect(streams, [1], 3)
    worker.restart(num_kv_blocks=8)
    await until(lambda: streams.is_accepting)
    assert streams.scheduler.num_preemptions == 0
    usage = streams.kv_cache_usage()
    assert (usage.preemptions, usage.total_blocks, usage.used_blocks) == (preemptions, 8, 0)
    assert_complete(await collect(streams, [1, 1, 1], 4), 4, 3)
    assert streams.kv_cache_usage().preemptions == preemptions
    await loop.stop()


@run_async
async def test_stop_ends_streams_waiting_for_a_dead_worker(pool):
    worker = FakeWorker(16, ["die"])
    streams, loop = await make_loop(pool, worker)
    with pytest.raises(NotReady):
        await collect(streams, [1], 3)
    await asyncio.wait_for(loop.stop(), TIMEOUT)
    assert not loop.is_running and not streams.is_accepting


@run_async
async def test_death_between_steps_fails_streams_without_waiting_for_the_restart(pool):
    worker = FakeWorker(16, ["down_after"])
    streams, loop = await make_loop(pool, worker)
    deltas = []
    try:
        with pytest.raises(NotReady):
            # The worker stays down: the stream must end now, not when (if) a replacement is ready.
            await collect(streams, [1, 1, 1], 5, deltas, timeout=0.5)
        # The step's token may or may not reach the stream first: the death fails it as soon as it is seen.
        assert [d.token_ids for d in deltas] in ([], [(TOKEN,)])
        assert worker.steps == 1 and streams.num_streams == 0
    finally:
        await loop.stop()


class GatedWorker(FakeWorker):
    """Each step waits for `gate`: streams added meanwhile wait for the next step."""

    def __init__(self, num_kv_blocks: int) -> None:
        super().__init__(num_kv_blocks)
        self.gate = asyncio.Event()
        self.computed: set[int] = set()

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        await self.gate.wait()
        self.computed.update(s.request_id for s in batch.sequences)
        return await super().execute(batch, generation)


@run_async
async def test_a_stream_cancelled_before_its_first_step_is_dropped_and_counted(pool):
    worker = GatedWorker(16)
    streams, loop = await make_loop(pool, worker)
    running = asyncio.create_task(collect(streams, [1, 1, 1], 3))
    await until(lambda: worker.steps == 0 and streams.scheduler.num_running == 1)
    queued = asyncio.create_task(collect(streams, [1, 1], 3))
    await until(lambda: streams.num_waiting == 1)
    queued.cancel()  # the client went away while its stream waited
    await asyncio.gather(queued, return_exceptions=True)
    assert (streams.num_dropped, streams.num_waiting) == (1, 0)

    worker.gate.set()
    assert_complete(await running, 3, 3)
    assert len(worker.computed) == 1, "the dropped stream never joined a step"
    # A stream cancelled after it ran is not a dropped one.
    worker.gate.clear()
    started = asyncio.create_task(collect(streams, [1, 1, 1], 3))
    await until(lambda: streams.scheduler.num_running == 1)
    started.cancel()
    await asyncio.gather(started, return_exceptions=True)
    assert streams.num_dropped == 1
    worker.gate.set()
    await loop.stop()
