"""A worker process: one replica of one model, fed batches over zmq by its engine's ProcessWorker.

Started as `python -m embedserv.executor.worker '<json WorkerArgs>'`. It loads and warms the model,
says ready, then runs two threads:
- the receiver takes each batch off the inbox and prepares it (packed inputs already on the device), so
  batch k+1 is ready when batch k ends;
- the main thread runs prepared batches in order and sends each result to the outbox.
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
from embedserv.executor import messages
from embedserv.executor.placement import Placement

# Named, not __name__: run with -m, this module is __main__.
logger = logging.getLogger("embedserv.executor.worker")

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


def _die_with_parent(parent_pid: int) -> None:
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

    from embedserv.engine.loading import build_replica, read_model_spec

    torch.set_num_threads(args.placement.threads)
    spec = read_model_spec(args.config)
    replica = build_replica(args.config, spec)
    replica.warm_up(spec.info.max_input_tokens, args.config.batch_token_budget)
    return replica


def _receive(replica, inbox: zmq.Socket, prepared: queue.Queue) -> None:
    """Receiver thread: decode each message and pack a prefill batch's inputs ahead of its turn."""
    try:
        _receive_forever(replica, inbox, prepared)
    except BaseException:
        # The main thread would wait forever for work: exit, so the engine replaces this worker now.
        logger.exception("the receiver thread failed")
        os._exit(1)


def _receive_forever(replica, inbox: zmq.Socket, prepared: queue.Queue) -> None:
    while True:
        message = messages.decode(inbox.recv_multipart(copy=False))
        if message.kind == messages.STOP:
            prepared.put(None)
            return
        work = message.payload
        if message.kind == messages.PREFILL:
            try:
                work = replica.prefill.prepare(message.payload)
            except Exception as exc:
                work = exc
        prepared.put((message, work))


def _run(replica, message: messages.Message, work, busy: float) -> tuple[list, float]:
    started = time.perf_counter()
    try:
        if isinstance(work, Exception):
            raise work
        if message.kind == messages.PREFILL:
            output = replica.prefill.run(work)
            busy += time.perf_counter() - started
            return messages.encode_prefill_result(message.batch_id, output, busy), busy
        batch, sampling = work
        sampled = replica.generation.execute(batch, sampling)
        busy += time.perf_counter() - started
        return messages.encode_generation_result(message.batch_id, sampled, busy), busy
    except Exception as exc:
        logger.exception("batch %d failed", message.batch_id)
        busy += time.perf_counter() - started
        return messages.encode_error(message.batch_id, f"{type(exc).__name__}: {exc}", busy), busy


def serve(replica, inbox: zmq.Socket, outbox: zmq.Socket, pipeline_depth: int) -> None:
    prepared: queue.Queue = queue.Queue(maxsize=pipeline_depth)
    threading.Thread(target=_receive, args=(replica, inbox, prepared), name="receive", daemon=True).start()
    busy = 0.0
    while True:
        item = prepared.get()
        if item is None:
            return
        frames, busy = _run(replica, *item, busy)
        outbox.send_multipart(frames, copy=False)


def main(argv: list[str]) -> int:
    args = WorkerArgs.from_json(argv[0])
    _die_with_parent(args.parent_pid)
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
        replica = _load(args)
    except Exception as exc:
        logger.exception("could not load the model")
        outbox.send_multipart(messages.encode_failed(str(exc)))
        outbox.close(linger=2000)
        return 1
    outbox.send_multipart(messages.encode_ready(os.getpid(), replica.num_kv_blocks))
    logger.info("ready on %s with %d threads", args.placement.device, args.placement.threads)
    serve(replica, inbox, outbox, args.config.pipeline_depth)
    outbox.close(linger=1000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
