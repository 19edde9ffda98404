"""A worker process: one replica of one model, fed steps over zmq by its engine's ProcessWorker.

Started as `python -m embedserv.executor.worker_main '<json WorkerArgs>'`, or forked by a zygote (started as
`python -m embedserv.executor.worker_main --zygote FD SERVER_PID`: executor/zygote.py), which then calls main().
It sets its allocator up for steps (worker/allocator.py), loads and warms the model, says ready, then runs two threads:
- the receiver takes each step off the inbox and prepares it (packed inputs already on the device), so
  step k+1 is ready when step k ends; a generation step comes as a delta, which it applies to the running
  batch this process keeps (executor/step_delta.py) first;
- the main thread runs prepared steps in order, records what each sampled in the running batch (the next
  decode's input), and sends each result to the outbox.
It never outlives the server: the kernel kills it when its parent dies (PR_SET_PDEATHSIG), and a watch
thread exits when the parent pid changes (the parent died before the prctl, or the platform has none).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

import zmq

from embedserv import logs
from embedserv.config import ModelConfig
from embedserv.executor.messages import CODEC, LoadFailed, Ready, RunGenerationStep, RunStep, StepDone, StepFailed
from embedserv.executor.placement import Placement
from embedserv.executor.step_delta import RunningBatch
from embedserv.start_up import freeze_start_up_objects

# Named, not __name__: run with -m, this module is __main__.
logger = logging.getLogger("embedserv.executor.worker_main")

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerArgs:
    config: ModelConfig
    placement: Placement
    name: str
    inbox: str
    outbox: str
    parent_pid: int
    log_level: str = "INFO"
    log_format: str = "text"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerArgs:
        raw = json.loads(text)
        placement = raw.pop("placement")
        cores = placement["cores"]
        return cls(
            config=ModelConfig(**raw.pop("config")),
            placement=Placement(placement["device"], placement["threads"], tuple(cores) if cores else None),
            **raw,
        )


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _load(args: WorkerArgs):
    import torch

    from embedserv.models.loading.spec_reader import read_model_spec
    from embedserv.worker import allocator
    from embedserv.worker.replica import build_runner

    allocator.keep_step_memory()
    logger.info("worker %s: %s malloc", args.name, allocator.in_use())
    torch.set_num_threads(args.placement.threads)
    spec = read_model_spec(args.config)
    runner = build_runner(args.config, spec)
    if args.config.warm_up:
        runner.warm_up(spec.info.max_input_tokens, args.config.batch_token_budget)
    allocator.release_free_memory()
    return runner


# The StepBatch each message runs: a prefill step's as sent, a generation step's rebuilt from the running batch.
_STEP_BATCH = {
    RunStep: lambda message, running: message.batch,
    RunGenerationStep: lambda message, running: running.apply(message.delta),
}


def _receive(runner, running: RunningBatch, inbox: zmq.Socket, prepared: queue.Queue) -> None:
    """Receiver thread: decode each step and pack its inputs ahead of its turn."""
    try:
        while True:
            message: RunStep | RunGenerationStep = CODEC.decode(inbox.recv_multipart(copy=False))
            try:
                work = runner.prepare(_STEP_BATCH[type(message)](message, running))
            except Exception as exc:
                work = exc
            prepared.put((message.step_id, work))
    except BaseException:
        # The main thread would wait forever for work: exit, so the engine replaces this worker now.
        logger.exception("the receiver thread failed")
        os._exit(1)


def _run(runner, running: RunningBatch, step_id: int, work, busy: float) -> tuple[object, float]:
    started = time.perf_counter()
    try:
        if isinstance(work, Exception):
            raise work
        output = runner.run(work)
        if output.sampled_request_ids:
            running.record(output)
        busy += time.perf_counter() - started
        return StepDone(step_id, output, busy), busy
    except Exception as exc:
        logger.exception("step %d failed", step_id)
        busy += time.perf_counter() - started
        return StepFailed(step_id, f"{type(exc).__name__}: {exc}", busy), busy


def serve(runner, inbox: zmq.Socket, outbox: zmq.Socket, pipeline_depth: int) -> None:
    prepared: queue.Queue = queue.Queue(maxsize=pipeline_depth)
    # The receiver applies generation deltas to it in step order; the main thread records sampled tokens,
    # always before the engine can send the step that reads them.
    running = RunningBatch()
    threading.Thread(target=_receive, args=(runner, running, inbox, prepared), name="receive", daemon=True).start()
    busy = 0.0
    while True:
        reply, busy = _run(runner, running, *prepared.get(), busy)
        outbox.send_multipart(CODEC.encode(reply), copy=False)


def main(argv: list[str]) -> int:
    args = WorkerArgs.from_json(argv[0])
    die_with_parent(args.parent_pid)
    if args.placement.cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, args.placement.cores)
    logs.configure(
        args.log_level,
        args.log_format,
        text_format=f"%(asctime)s %(levelname)s %(name)s [worker {args.name} pid {os.getpid()}]: %(message)s",
        extra={"worker": args.name, "pid": os.getpid()},
    )
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(args.outbox)
    try:
        runner = _load(args)
    except Exception as exc:
        logger.exception("could not load the model")
        outbox.send_multipart(CODEC.encode(LoadFailed(str(exc))))
        # Waits (up to 2 s) for it to leave: the process's exit would not (a forked worker ends with os._exit).
        context.destroy(linger=2000)
        return 1
    # The model's objects stay for the process's life: a full collection need not walk them between steps.
    freeze_start_up_objects()
    outbox.send_multipart(CODEC.encode(Ready(os.getpid(), runner.kv_cache_layout())))
    logger.info("ready on %s with %d threads", args.placement.device, args.placement.threads)
    serve(runner, inbox, outbox, args.config.pipeline_depth)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:  # executor/zygote.py: the process that forks workers
        from embedserv.executor import zygote

        zygote.serve(int(sys.argv[2]), int(sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
