"""One worker process seen from the engine: start it, send it batches, notice its death, replace it.

Each process gets fresh zmq sockets (ipc, in a private temp directory): a PUSH inbox for batches and a
PULL outbox for results. A message meant for a dead process can never reach its successor.

Generation steps go as deltas against the running batch the process keeps (executor/step_delta.py); each
process gets a fresh DeltaEncoder, so a successor is sent every request it runs whole. A generation step that
fails or never gets its answer leaves the process's state unknown: the next one starts over (reset).

A supervisor task polls the process. When it exits, is killed, or runs one batch past the watchdog limit
(and is then killed), every batch on it fails with WorkerDied and a new process is started, after a pause
that doubles while new processes die before becoming ready (0.5 s up to 30 s).

Past its memory ceiling (--worker-memory-limit, memory_ceiling.py) a process is replaced between steps, not
killed: it is `recycling` (no new prefill steps or generation streams, which wait for its successor), and once
it has no step in flight and the engine says it is idle (no generation stream left), it is stopped and a new
one started at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from embedserv import logs, memory_ceiling
from embedserv.config import ModelConfig
from embedserv.errors import ConfigError, NotReady
from embedserv.executor import worker_main, zygote
from embedserv.executor.base import WorkerDied, WorkerStats
from embedserv.executor.messages import CODEC, LoadFailed, Ready, RunGenerationStep, RunStep, StepDone, StepFailed
from embedserv.executor.placement import Placement
from embedserv.executor.step_delta import DeltaEncoder
from embedserv.executor.worker_main import WorkerArgs
from embedserv.executor.zygote import ForkedProcess
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.steps import StepBatch, StepOutput
from embedserv.worker import allocator

logger = logging.getLogger(__name__)

_POLL_S = 0.1
_STOP_GRACE_S = 5.0
_MAX_RESTART_DELAY_S = 30.0
_MEMORY_CHECK_S = 1.0


def cpu_process_environment(cpu_allocator: str) -> dict[str, str]:
    """This process's environment as a CPU worker gets it, but for its thread counts: its zygote's."""
    threads = zygote.cpu_thread_environment(os.environ)
    return dict(os.environ) | threads | allocator.worker_environment(cpu_allocator, "cpu")


class ProcessWorker:
    def __init__(self, index: int, config: ModelConfig, placement: Placement) -> None:
        self.index = index
        self.name = f"{config.served_name}/{index}"
        self.config = config
        self.placement = placement
        self.kv_cache: KvCacheLayout | None = None
        self.incarnation = 0
        self.restarts = 0
        # Called with no arguments whenever `ready` may have changed (the engine sets it).
        self.on_change: Callable[[], None] = lambda: None
        # Past the memory ceiling (0: none): replaced once it has no step in flight and `idle()` (the engine sets
        # it for generation: no stream left on this process).
        self.memory_limit = memory_ceiling.ceiling_bytes(config.worker_memory_limit, config.data_parallel_size)
        self.recycling = False
        self.idle: Callable[[], bool] = lambda: True
        self.memory_restarts = 0
        self.rss = 0
        self._next_memory_check = 0.0
        self._below_model = False
        self._context = zmq.asyncio.Context()
        self._socket_dir = tempfile.mkdtemp(prefix="embedserv-")
        self._proc: subprocess.Popen | ForkedProcess | None = None
        self._launching: asyncio.Future | None = None
        self._inbox: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._supervisor: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._failure: str | None = None
        # The steps sent and not answered, oldest first: the process answers them in the order they came.
        self._pending: deque[tuple[int, asyncio.Future]] = deque()
        self._step_ids = itertools.count()
        self._last_progress = time.monotonic()
        self._batches = 0
        self._busy_seconds = 0.0
        self._deltas = DeltaEncoder()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def stats(self) -> WorkerStats:
        return WorkerStats(
            self.index, self.pid, self.ready, self.restarts, self._batches, self._busy_seconds, self.memory_restarts,
            self.rss,
        )  # fmt: skip

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def launch(self) -> None:
        """Starts the first process without waiting for it (start() then waits); on the event loop."""
        if self._launching is None:
            self._launching = asyncio.ensure_future(self._launch())

    async def start(self) -> None:
        """Starts the first process (unless launch() did) and returns once it is ready; one that cannot load
        raises ConfigError."""
        self.launch()
        await self._launching
        while not self.ready:
            if self._proc.poll() is not None:
                await self._read_failure()
                await self._reap()
                reason = self._failure or f"exit code {self._proc.returncode}"
                raise ConfigError(f"worker {self.name} could not start: {reason}")
            await asyncio.sleep(_POLL_S)
        self._supervisor = asyncio.create_task(self._supervise(), name=f"supervise-{self.name}")

    async def stop(self) -> None:
        if self._launching is not None and not self._launching.done():
            self._launching.cancel()
            await asyncio.gather(self._launching, return_exceptions=True)
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            if not await self._wait_exit(_STOP_GRACE_S):
                self._proc.kill()
                await self._wait_exit(_STOP_GRACE_S)
        await self._reap(NotReady(f"worker {self.name} is shutting down; retry on another replica"))
        self._context.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    async def execute(self, batch: StepBatch, generation: bool = False) -> StepOutput:
        if not self.ready:
            raise WorkerDied(f"worker {self.name} is restarting", sent=False)
        step_id = next(self._step_ids)
        future = asyncio.get_running_loop().create_future()
        if not self._pending:
            self._last_progress = time.monotonic()
        pending = (step_id, future)
        try:
            message = RunGenerationStep(step_id, self._deltas.encode(batch)) if generation else RunStep(step_id, batch)
            frames = CODEC.encode(message)
            # In the deque before it is sent: its answer may come before the send returns.
            self._pending.append(pending)
            try:
                await self._inbox.send_multipart(frames, copy=False)
            except BaseException:
                self._pending.remove(pending)
                raise
            reply = await future
        except BaseException:
            if generation:
                self._deltas.reset()
            raise
        if isinstance(reply, StepFailed):
            if generation:
                self._deltas.reset()
            raise RuntimeError(reply.message)
        return reply.output

    async def _launch(self) -> None:
        self.incarnation += 1
        self._deltas = DeltaEncoder()
        base = f"ipc://{self._socket_dir}/{self.incarnation}"
        self._inbox = self._context.socket(zmq.PUSH)
        self._inbox.bind(f"{base}-in")
        outbox = self._context.socket(zmq.PULL)
        outbox.bind(f"{base}-out")
        args = WorkerArgs(
            config=self.config,
            placement=self.placement,
            name=self.name,
            inbox=f"{base}-in",
            outbox=f"{base}-out",
            parent_pid=os.getpid(),
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            log_format=logs.current_format(),
        )
        threads = str(self.placement.threads)
        own = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        if self.placement.device == "cpu":
            env = cpu_process_environment(self.config.cpu_allocator) | own
        else:
            env = (
                dict(os.environ) | own | allocator.worker_environment(self.config.cpu_allocator, self.placement.device)
            )
        self._proc = await self._start_process(args, env)
        self._failure = None
        self._receiver = asyncio.create_task(self._receive(outbox), name=f"receive-{self.name}")
        logger.info("started worker %s (pid %d) on %s", self.name, self._proc.pid, self.placement.device)

    async def _start_process(self, args: WorkerArgs, env: dict[str, str]) -> subprocess.Popen | ForkedProcess:
        """The process, forked by the zygote for `env` where there can be one (executor/zygote.py: it imports while
        the server reads the model, once for every worker), else started plain. Either way in a session of its own:
        a terminal's Ctrl-C reaches only the server, which then stops the workers in order."""
        forks = zygote.for_environment(env) if self.placement.device == "cpu" else None
        if forks is not None:
            started = await forks.started()
            forked = forks.fork(worker_main.main, ([args.to_json()],), env, zygote.WORKER_NAME) if started else None
            if forked is not None:
                return forked
            logger.warning("worker %s: the zygote could not fork it (exit code %s); starting it plain", self.name,
                           forks.proc.poll())  # fmt: skip
        return subprocess.Popen(
            [sys.executable, "-m", "embedserv.executor.worker_main", args.to_json()], env=env, start_new_session=True
        )

    async def _receive(self, outbox: zmq.asyncio.Socket) -> None:
        handlers = {
            Ready: self._ready_message,
            LoadFailed: self._load_failed,
            StepDone: self._answer,
            StepFailed: self._answer,
        }
        try:
            while True:
                message = CODEC.decode(await outbox.recv_multipart(copy=False))
                handler = handlers.get(type(message))
                if handler is None:
                    raise ValueError(f"a worker sent {type(message).__name__}, which only the engine sends")
                handler(message)
        finally:
            outbox.close(linger=0)

    def _ready_message(self, ready: Ready) -> None:
        self.kv_cache = ready.kv_cache
        self._ready.set()
        self.on_change()

    def _load_failed(self, failed: LoadFailed) -> None:
        self._failure = failed.message

    def _answer(self, reply: StepDone | StepFailed) -> None:
        """A step's answer: for the oldest step in flight (a worker runs its steps in the order they came)."""
        self._batches += 1
        self._busy_seconds = reply.busy_seconds
        self._last_progress = time.monotonic()
        step_id, future = self._pending.popleft()
        if step_id != reply.step_id:
            raise ValueError(f"worker answered step {reply.step_id}, but step {step_id} came first")
        if not future.done():
            future.set_result(reply)

    async def _read_failure(self) -> None:
        """Gives the receiver a moment to read the reason a process that just exited sent before it went."""
        for _ in range(20):
            if self._failure is not None:
                return
            await asyncio.sleep(0.05)

    async def _supervise(self) -> None:
        failures = 0
        while True:
            await self._watch()
            if self.recycling:
                await self._replace()
                continue
            was_ready = self.ready
            code = self._proc.returncode
            if not was_ready:
                await self._read_failure()
            await self._reap()
            failures = 0 if was_ready else failures + 1
            delay = min(_MAX_RESTART_DELAY_S, 0.5 * 2**failures)
            logger.error(
                "worker %s (pid %d) died (exit code %s%s); starting a new one in %.1f s",
                self.name,
                self._proc.pid,
                code,
                f": {self._failure}" if self._failure else "",
                delay,
            )
            await asyncio.sleep(delay)
            self.restarts += 1
            self._batches = 0
            self._busy_seconds = 0.0
            await self._launch()

    async def _replace(self) -> None:
        """Stops the idle process past its memory ceiling and starts its successor at once."""
        self._proc.terminate()
        if not await self._wait_exit(_STOP_GRACE_S):
            self._proc.kill()
            await self._wait_exit(_STOP_GRACE_S)
        await self._reap()
        self.restarts += 1
        self.memory_restarts += 1
        self._batches = 0
        self._busy_seconds = 0.0
        await self._launch()
        # Ready, or dead before it (the supervisor's next watch then handles it as any death).
        while not self.ready and self._proc.poll() is None:
            await asyncio.sleep(_POLL_S)
        self.recycling = False
        self.on_change()

    def _check_memory(self) -> bool:
        """Whether the process should be replaced now: past its ceiling (read each second) and idle. A process
        past it before its first step is not replaced: a successor would be too, the ceiling is below the model."""
        now = time.monotonic()
        if self.memory_limit and not self.recycling and now >= self._next_memory_check and self.ready:
            self._next_memory_check = now + _MEMORY_CHECK_S
            self.rss = memory_ceiling.rss_bytes(self._proc.pid) or 0
            if self.rss > self.memory_limit:
                if self._batches == 0:
                    if not self._below_model:
                        logger.error(
                            "worker %s holds %.0f MiB before its first step, past --worker-memory-limit (%.0f MiB): a "
                            "new process would be too, so it is not replaced; raise the limit",
                            self.name, self.rss / 2**20, self.memory_limit / 2**20,
                        )  # fmt: skip
                    self._below_model = True
                    return False
                logger.warning(
                    "worker %s (pid %d) holds %.0f MiB, past --worker-memory-limit (%.0f MiB): replacing it once its "
                    "steps in flight end",
                    self.name,
                    self._proc.pid,
                    self.rss / 2**20,
                    self.memory_limit / 2**20,
                )
                self.recycling = True
                self.on_change()
        return self.recycling and not self._pending and self.idle()

    async def _watch(self) -> None:
        """Returns once the process has exited, or is to be replaced (`recycling`, and idle); kills it first if
        a batch has run past the watchdog limit."""
        while self._proc.poll() is None:
            if self._check_memory():
                return
            stalled = time.monotonic() - self._last_progress
            if self._pending and stalled > self.config.worker_timeout:
                logger.error(
                    "worker %s (pid %d) made no progress for %.0f s (--worker-timeout); killing it",
                    self.name,
                    self._proc.pid,
                    stalled,
                )
                self._proc.kill()
            await asyncio.sleep(_POLL_S)

    async def _reap(self, error: Exception | None = None) -> None:
        """After the process has gone: not ready, its batches failed, its sockets closed."""
        self._ready.clear()
        self.on_change()
        for _, future in self._pending:
            if not future.done():
                future.set_exception(error or WorkerDied(f"worker {self.name} died while running the batch", True))
        self._pending.clear()
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self._inbox is not None:
            self._inbox.close(linger=0)
            self._inbox = None

    async def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True
