"""The in-process worker: the replica on one model thread of this process (library use and most tests).

It pipelines as a worker process does (executor/worker_main.py): a prepare thread packs each step's inputs in
the order the steps came, and queues the step on the model thread, so with a pipeline depth of 2 step k+1
is prepared while step k runs and starts as soon as step k ends, without waiting on the event loop.
Preparing touches no OpenMP-parallel torch op (host arrays, one copy to the device), so the model
thread's OpenMP team stays the only one.

Generation steps take the same path as to a worker process (executor/step_delta.py): the step is encoded as a
delta on the event loop, applied to this worker's running batch on the prepare thread, and the model thread
records what it sampled; only the codec's bytes are skipped. A generation step that raises starts the
deltas over.

It never dies; a batch that raises fails only its own requests.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

from embedserv.executor.base import WorkerStats
from embedserv.executor.step_delta import DeltaEncoder, RunningBatch, StepDelta
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.steps import StepBatch, StepOutput
from embedserv.worker.model_runner import ModelRunner, PreparedStep


class LocalWorker:
    index = 0
    incarnation = 1
    # It has no memory ceiling of its own (it is this process).
    recycling = False

    def __init__(self, runner: ModelRunner, model_thread: ThreadPoolExecutor) -> None:
        self.runner = runner
        self.kv_cache: KvCacheLayout | None = runner.kv_cache_layout()
        # Never called: this worker is always ready.
        self.on_change = lambda: None
        self.idle = lambda: True
        self._model_thread = model_thread
        self._prepare_thread = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self._batches = 0
        self._busy_seconds = 0.0
        self._deltas = DeltaEncoder()
        self._running = RunningBatch()

    @property
    def ready(self) -> bool:
        return True

    def stats(self) -> WorkerStats:
        return WorkerStats(self.index, os.getpid(), True, 0, self._batches, self._busy_seconds)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._prepare_thread.shutdown(wait=True)
        self._model_thread.shutdown(wait=True)

    async def wait_ready(self) -> None:
        return None

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        try:
            work = self._deltas.encode(batch) if generation else batch
            run = await asyncio.get_running_loop().run_in_executor(self._prepare_thread, self._prepare_and_queue, work)
            return await asyncio.wrap_future(run)
        except BaseException:
            if generation:
                self._deltas.reset()
            raise
        finally:
            self._batches += 1

    def _prepare_and_queue(self, work: StepBatch | StepDelta) -> Future:
        """Prepare thread: the step's inputs, then the step queued on the model thread. Steps are prepared
        and queued in the order they came (one prepare thread), so they run in that order too (and the KV
        cache's fresh blocks are marked in step order)."""
        try:
            batch = self._running.apply(work) if isinstance(work, StepDelta) else work
            prepared = self.runner.prepare(batch)
        except Exception as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed
        return self._model_thread.submit(self._run, prepared)

    def _run(self, prepared: PreparedStep) -> StepOutput:
        started = time.perf_counter()
        try:
            output = self.runner.run(prepared)
            if output.sampled_request_ids:
                self._running.record(output)
            return output
        finally:
            self._busy_seconds += time.perf_counter() - started
