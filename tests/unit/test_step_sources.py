"""The dispatcher gives a worker its own generation steps before the shared prefill batches, one step at a
time from a source that says so; the in-process worker pipelines as a worker process does: step k+1 is
prepared while step k runs, before step k's result reaches the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embedserv.config import ModelConfig
from embedserv.engine.core.dispatch import Dispatcher, Step
from embedserv.engine.sync import SyncEngine
from embedserv.executor.local_worker import LocalWorker
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import EmbedParams
from tests.helpers.aio import run_async

TIMEOUT = 5.0


def _batch(request_id: int) -> StepBatch:
    return StepBatch((ScheduledSequence(request_id, (1, 2, 3), OutputKind.POOL),))


def _output(batch: StepBatch) -> StepOutput:
    ids = tuple(s.request_id for s in batch.sequences)
    rows = np.zeros((len(ids), 1), dtype=np.float32)
    return StepOutput(row_request_ids=ids, rows=rows, sampled_request_ids=(), tokens=np.zeros(0, np.int64))


class FakeSource:
    """A step source with a fixed list of batches; records what it resolved."""

    def __init__(self, batches: list[StepBatch], one_step_at_a_time: bool = False) -> None:
        self.batches = list(batches)
        self.one_step_at_a_time = one_step_at_a_time
        self.done: list[int] = []

    def schedule(self) -> Step | None:
        return Step(self.batches.pop(0)) if self.batches else None

    async def step_done(self, step, output, worker, started) -> None:
        self.done.extend(s.request_id for s in step.batch.sequences)

    def step_failed(self, step, exc) -> None:
        raise AssertionError(f"step failed: {exc}")

    def worker_died(self, step, died) -> None:
        raise AssertionError(f"worker died: {died}")

    def fail_all(self, error) -> None: ...


class RecordingWorker:
    """Runs every step at once, in order, and records which ran."""

    index = 0
    incarnation = 1
    kv_cache = None
    ready = True

    def __init__(self) -> None:
        self.on_change = lambda: None
        self.recycling = False
        self.idle = lambda: True
        self.ran: list[int] = []

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        self.ran.extend(s.request_id for s in batch.sequences)
        await asyncio.sleep(0)
        return _output(batch)


async def _run_dispatcher(streams: FakeSource, prefill: FakeSource, depth: int, expected_steps: int) -> list[int]:
    """One worker: `streams` its own (generation) source, `prefill` the shared one."""
    worker = RecordingWorker()
    dispatcher = Dispatcher("m", [worker], prefill, [streams], depth)
    dispatcher.start()
    try:
        while len(streams.done) + len(prefill.done) < expected_steps:
            await asyncio.wait_for(asyncio.sleep(0.001), TIMEOUT)
    finally:
        await dispatcher.stop()
    return worker.ran


@run_async
async def test_the_workers_own_steps_come_before_the_shared_ones():
    first, second = FakeSource([_batch(1), _batch(2)]), FakeSource([_batch(11), _batch(12)])
    assert await _run_dispatcher(first, second, 1, 4) == [1, 2, 11, 12]
    first, second = FakeSource([_batch(1), _batch(2)]), FakeSource([_batch(11), _batch(12)])
    assert await _run_dispatcher(second, first, 1, 4) == [11, 12, 1, 2]


@run_async
async def test_a_one_step_at_a_time_source_waits_for_its_step_while_later_sources_go_on():
    generation = FakeSource([_batch(1), _batch(2)], one_step_at_a_time=True)
    prefill = FakeSource([_batch(11), _batch(12)])
    ran = await _run_dispatcher(generation, prefill, 2, 4)
    assert ran[:2] == [1, 11], "with room for 2 steps, the second comes from the next source"
    assert sorted(ran) == [1, 2, 11, 12]


class GatedRunner:
    """A ModelRunner stand-in: the first step's run waits (up to TIMEOUT) until a second step is prepared."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.second_prepared = threading.Event()
        self._lock = threading.Lock()

    def kv_cache_layout(self):
        return None

    def _record(self, what: str, request_id: int) -> None:
        with self._lock:
            self.events.append((what, request_id))

    def prepare(self, batch: StepBatch) -> StepBatch:
        self._record("prepare", batch.sequences[0].request_id)
        if sum(1 for what, _ in self.events if what == "prepare") >= 2:
            self.second_prepared.set()
        return batch

    def run(self, prepared: StepBatch) -> StepOutput:
        request_id = prepared.sequences[0].request_id
        self._record("run", request_id)
        if len([e for e in self.events if e[0] == "run"]) == 1:
            self.second_prepared.wait(TIMEOUT)
        self._record("ran", request_id)
        return _output(prepared)


@run_async
async def test_the_in_process_worker_prepares_the_next_step_while_one_runs():
    runner = GatedRunner()
    worker = LocalWorker(runner, ThreadPoolExecutor(1))
    source = FakeSource([_batch(1), _batch(2), _batch(3)])
    consumed = []

    async def step_done(step, output, worker, started) -> None:
        consumed.append(step.batch.sequences[0].request_id)
        runner._record("consumed", step.batch.sequences[0].request_id)

    source.step_done = step_done
    dispatcher = Dispatcher("m", [worker], source, [], 2)
    dispatcher.start()
    try:
        while len(consumed) < 3:
            await asyncio.wait_for(asyncio.sleep(0.001), TIMEOUT)
    finally:
        await dispatcher.stop()
        await worker.stop()

    events = runner.events
    assert runner.second_prepared.is_set()
    assert events.index(("prepare", 2)) < events.index(("ran", 1)), events
    assert events.index(("prepare", 2)) < events.index(("consumed", 1)), events
    assert [e[1] for e in events if e[0] == "run"] == [1, 2, 3], "steps run in the order they came"
    assert consumed == [1, 2, 3]
    assert worker.stats().batches == 3


def test_an_in_process_engine_prepares_a_batch_while_the_one_before_runs(bundled_dir):
    config = ModelConfig(path=str(bundled_dir), served_name="m", max_batch_requests=1, pipeline_depth=2)
    with SyncEngine(config, warm_up=False) as engine:
        runner = engine.core.workers[0].runner
        prepare, run = runner.prepare, runner.run
        prepared, ran = [], []
        second_prepared_first_running = threading.Event()
        first_ran = threading.Event()

        def recording_prepare(batch):
            prepared.append(batch)
            if len(prepared) == 2 and not first_ran.is_set():
                second_prepared_first_running.set()
            return prepare(batch)

        def waiting_run(step):
            ran.append(step)
            if len(ran) > 1:
                return run(step)
            # The first batch waits here until the second is prepared; a worker that does not pipeline
            # prepares nothing until this run returns (the wait then times out).
            second_prepared_first_running.wait(TIMEOUT)
            try:
                return run(step)
            finally:
                first_ran.set()

        runner.prepare, runner.run = recording_prepare, waiting_run
        results = engine.embed_concurrently([["first text"], ["second text"]], EmbedParams())
    assert second_prepared_first_running.is_set()
    assert [r.embeddings.shape for r in results] == [(1, 384), (1, 384)]
