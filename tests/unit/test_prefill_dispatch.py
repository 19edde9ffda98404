"""PrefillWork and the Dispatcher over fake workers, wired as LocalCore wires them: ordering, pipeline depth,
least-busy dispatch, retry on worker death, failures."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embedserv.engine.core.dispatch import Dispatcher
from embedserv.engine.core.prefill_work import MAX_ATTEMPTS, PrefillWork
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.errors import NotReady
from embedserv.executor.base import WorkerDied, WorkerStats
from embedserv.steps import OutputKind, StepBatch, StepOutput
from tests.helpers.aio import run_async

TIMEOUT = 5.0


class FakeWorker:
    """Each execute call takes the next behaviour (or `default`): ok, hang (until release()), die (WorkerDied
    sent=True, stays ready), die_down (goes not ready, says so, dies), die_silent (not ready, no on_change, dies),
    unsent (WorkerDied sent=False), error."""

    def __init__(self, index: int, behaviours=(), default: str = "ok", ready: bool = True) -> None:
        self.index = index
        self.kv_cache = None
        self.incarnation = 1
        self.on_change = lambda: None
        self.recycling = False
        self.idle = lambda: True
        self._ready = ready
        self.behaviours = list(behaviours)
        self.default = default
        self.calls: list[tuple[int, ...]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._gates: list[asyncio.Event] = []

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool) -> None:
        self._ready = ready
        self.on_change()

    def stats(self) -> WorkerStats:
        return WorkerStats(self.index, 0, self._ready, 0, len(self.calls), 0.0)

    async def wait_ready(self) -> None: ...

    start = stop = wait_ready

    def release(self) -> None:
        for gate in self._gates:
            gate.set()

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        ids = tuple(s.request_id for s in batch.sequences)
        self.calls.append(ids)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            behaviour = self.behaviours.pop(0) if self.behaviours else self.default
            await asyncio.sleep(0)
            if behaviour == "hang":
                self._gates.append(asyncio.Event())
                await self._gates[-1].wait()
            elif behaviour == "error":
                raise ValueError("boom")
            elif behaviour == "unsent":
                raise WorkerDied(f"worker {self.index} is restarting", sent=False)
            elif behaviour.startswith("die"):
                if behaviour == "die_down":
                    self.set_ready(False)
                elif behaviour == "die_silent":
                    self._ready = False
                raise WorkerDied(f"worker {self.index} died while running the batch", sent=True)
            rows = np.array([[float(sum(s.token_ids))] for s in batch.sequences], dtype=np.float32)
            return StepOutput(row_request_ids=ids, rows=rows, sampled_request_ids=(), tokens=np.zeros(0, np.int64))
        finally:
            self.in_flight -= 1


class Dispatch:
    """The prefill side of a LocalCore without the model: the shared work and the dispatcher, wired and
    started and stopped as LocalCore.__init__ / start / stop / _workers_changed do."""

    def __init__(self, workers, depth: int, max_batch_tokens: int, max_batch_requests: int) -> None:
        self.workers = workers
        self.queue = PrefillWork(
            "m", workers, max_batch_tokens, max_batch_requests, OutputKind.POOL, lambda: self.dispatcher.wake()
        )
        self.dispatcher = Dispatcher("m", workers, self.queue, [], depth)
        for worker in workers:
            worker.on_change = self.workers_changed

    def workers_changed(self) -> None:
        self.queue.workers_changed()
        self.dispatcher.wake()

    def start(self) -> None:
        self.dispatcher.start()
        self.queue.accepting = True
        self.workers_changed()

    async def stop(self) -> None:
        await self.dispatcher.stop()
        self.queue.fail_all(NotReady("model m is shutting down; retry on another replica"))

    @property
    def is_running(self) -> bool:
        return self.dispatcher.is_running

    def new_request(self, token_ids, pool_start: int = 0, token_type_ids=None):
        return self.queue.new_request(InputSequence(token_ids, pool_start, token_type_ids))

    async def run(self, requests):
        return await self.queue.run(requests)


def make_loop(workers, depth: int = 2, max_batch_requests: int = 1, max_batch_tokens: int = 1000) -> Dispatch:
    loop = Dispatch(workers, depth, max_batch_tokens, max_batch_requests)
    loop.start()
    return loop


async def call(loop: Dispatch, *token_lists):
    requests = [loop.new_request(list(tokens)) for tokens in token_lists]
    return requests, await asyncio.wait_for(loop.run(requests), TIMEOUT)


async def settle(ticks: int = 20) -> None:
    for _ in range(ticks):
        await asyncio.sleep(0)


async def drain(workers, tasks) -> None:
    """Releases hung batches until every task is done."""

    async def go():
        while not all(task.done() for task in tasks):
            for worker in workers:
                worker.release()
            await asyncio.sleep(0)

    await asyncio.wait_for(go(), TIMEOUT)


def values(results) -> list[float]:
    return [float(output.row[0]) for output in results]


@run_async
async def test_rows_come_back_in_request_order_for_every_concurrent_call():
    workers = [FakeWorker(0), FakeWorker(1)]
    loop = make_loop(workers, max_batch_requests=3)
    _, results = await call(loop, [1], [2, 3], [10], [4, 4, 4], [7])
    assert values(results) == [1.0, 5.0, 10.0, 12.0, 7.0]
    assert all(output.started <= output.finished for output in results)
    outcomes = await asyncio.gather(*(call(loop, [i], [i, 100]) for i in range(30)))
    assert [values(results) for _, results in outcomes] == [[float(i), float(i + 100)] for i in range(30)]
    assert sum(len(ids) for w in workers for ids in w.calls) == 65
    await loop.stop()


@pytest.mark.parametrize("depth", [1, 2])
@run_async
async def test_a_worker_holds_at_most_pipeline_depth_batches(depth):
    worker = FakeWorker(0, default="hang")
    loop = make_loop([worker], depth=depth)
    tasks = [asyncio.create_task(call(loop, [i])) for i in range(5)]
    await settle()
    assert len(worker.calls) == depth and worker.in_flight == depth
    await drain([worker], tasks)
    assert [values(t.result()[1]) for t in tasks] == [[float(i)] for i in range(5)]
    assert (worker.max_in_flight, len(worker.calls)) == (depth, 5)
    await loop.stop()


@run_async
async def test_dispatch_prefers_the_least_busy_worker():
    workers = [FakeWorker(0, default="hang"), FakeWorker(1, default="hang")]
    loop = make_loop(workers, depth=2)
    tasks = [asyncio.create_task(call(loop, [i])) for i in range(2)]
    await settle()
    assert [len(w.calls) for w in workers] == [1, 1]
    tasks += [asyncio.create_task(call(loop, [i])) for i in range(2, 5)]
    await settle()
    assert [len(w.calls) for w in workers] == [2, 2] and not tasks[4].done()  # both full: the fifth waits
    await drain(workers, tasks)
    assert [w.max_in_flight for w in workers] == [2, 2]
    await loop.stop()


@run_async
async def test_sequences_of_a_dead_worker_are_retried_on_another():
    workers = [FakeWorker(0, ["die_down"]), FakeWorker(1)]
    loop = make_loop(workers, max_batch_requests=3)
    requests, results = await call(loop, [1], [2], [3])
    assert values(results) == [1.0, 2.0, 3.0]
    ids = tuple(r.request_id for r in requests)
    assert workers[0].calls == [ids] and workers[1].calls == [ids]
    assert [r.attempts for r in requests] == [1, 1, 1]
    await loop.stop()


@run_async
async def test_a_sequence_runs_at_most_twice():
    # Worker 1 dies but stays ready, worker 2 would succeed: still no third try.
    workers = [FakeWorker(0, ["die_down"]), FakeWorker(1, ["die"]), FakeWorker(2)]
    loop = make_loop(workers, max_batch_requests=2)
    with pytest.raises(NotReady, match="died while running the batch; retry the call"):
        await call(loop, [1], [2])
    assert MAX_ATTEMPTS == 2
    assert (len(workers[0].calls), len(workers[1].calls), workers[2].calls) == (1, 1, [])
    assert values((await call(loop, [9]))[1]) == [9.0]  # the survivors keep serving
    await loop.stop()


@pytest.mark.parametrize("behaviour", ["die_down", "die_silent"])
@run_async
async def test_death_of_the_only_worker_fails_at_once(behaviour):
    worker = FakeWorker(0, [behaviour])
    loop = make_loop([worker])
    with pytest.raises(NotReady):
        await call(loop, [1])
    with pytest.raises(NotReady, match="no worker of model m is running"):
        await call(loop, [2])
    assert len(worker.calls) == 1
    await loop.stop()


@run_async
async def test_unsent_batch_is_requeued_without_counting_an_attempt():
    # If the unsent tries counted, the sent death would be the second attempt and fail the call.
    worker = FakeWorker(0, ["unsent", "unsent", "die", "ok"])
    loop = make_loop([worker])
    requests, results = await call(loop, [4])
    assert values(results) == [4.0] and len(worker.calls) == 4 and requests[0].attempts == 1
    await loop.stop()


@run_async
async def test_failing_batch_fails_only_its_own_calls():
    worker = FakeWorker(0, ["error"])
    loop = make_loop([worker], depth=2)
    failing = asyncio.create_task(call(loop, [1]))
    other = asyncio.create_task(call(loop, [2]))
    with pytest.raises(RuntimeError, match="^inference failed: boom$") as info:
        await asyncio.wait_for(failing, TIMEOUT)
    assert type(info.value) is RuntimeError
    assert values((await asyncio.wait_for(other, TIMEOUT))[1]) == [2.0]
    assert values((await call(loop, [3]))[1]) == [3.0]
    await loop.stop()


@run_async
async def test_no_ready_worker_fails_queued_calls_and_refuses_new_ones():
    """Queued calls fail at once; the call on the worker is left to its batch."""
    worker = FakeWorker(0, ["hang"])
    loop = make_loop([worker], depth=1)
    running = asyncio.create_task(call(loop, [1]))
    await settle()
    queued_requests = [loop.new_request([2])]
    queued = asyncio.create_task(asyncio.wait_for(loop.run(queued_requests), TIMEOUT))
    await settle()
    assert len(worker.calls) == 1
    worker.set_ready(False)
    with pytest.raises(NotReady, match="restarting"):
        await asyncio.wait_for(queued, TIMEOUT)
    # A batch already on a worker ends with that batch (a real worker's death fails it with WorkerDied).
    assert not running.done()
    worker.release()
    await asyncio.wait_for(running, TIMEOUT)
    worker.set_ready(True)
    requests, results = await call(loop, [4])
    assert values(results) == [4.0]
    # The failed queued call never reached the worker, not even once it was back.
    assert queued_requests[0].cancelled
    assert worker.calls[1:] == [(requests[0].request_id,)]
    await loop.stop()


@run_async
async def test_run_without_a_ready_worker_or_before_start_raises_at_once():
    worker = FakeWorker(0, ready=False)
    loop = Dispatch([worker], depth=2, max_batch_tokens=1000, max_batch_requests=8)
    with pytest.raises(NotReady, match="not running"):
        await loop.run([loop.new_request([1])])
    loop.start()
    with pytest.raises(NotReady, match="no worker"):
        await call(loop, [1])
    assert worker.calls == []
    await loop.stop()


@run_async
async def test_cancelled_caller_is_dropped_before_reaching_a_worker():
    worker = FakeWorker(0, ["hang"])
    loop = make_loop([worker], depth=1)
    first = asyncio.create_task(call(loop, [1]))
    await settle()
    cancelled_requests = [loop.new_request([2]), loop.new_request([3])]
    cancelled = asyncio.create_task(loop.run(cancelled_requests))
    await settle()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert all(r.cancelled for r in cancelled_requests)
    await drain([worker], [first])
    assert values((await call(loop, [5]))[1]) == [5.0]
    assert len(worker.calls) == 2
    assert not {rid for ids in worker.calls for rid in ids} & {r.request_id for r in cancelled_requests}
    await loop.stop()


@run_async
async def test_stop_fails_pending_calls():
    worker = FakeWorker(0, default="hang")
    loop = make_loop([worker], depth=1)
    running = asyncio.create_task(call(loop, [1]))
    await settle()
    queued = asyncio.create_task(call(loop, [2]))
    await settle()
    await asyncio.wait_for(loop.stop(), TIMEOUT)
    for task in (running, queued):
        with pytest.raises(NotReady, match="shutting down"):
            await asyncio.wait_for(task, TIMEOUT)
    assert not loop.is_running and len(worker.calls) == 1
    with pytest.raises(NotReady, match="not running"):
        await call(loop, [3])
