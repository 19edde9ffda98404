"""The engine host's side of `--frontends N`: it starts N front-end processes and answers their calls.

The front ends (server/frontend_process.py) listen on the server's gRPC and HTTP ports together
(SO_REUSEPORT: the kernel spreads new connections over the listeners). Each parses, checks and tokenizes its
calls and sends the input sequences here over one zmq ROUTER socket; the host's cores schedule them all in one
queue per model, and their workers are this process's. This process serves no call itself: its event loop is
left to scheduling. It keeps both ports bound (never listening) from before the front ends start to the end,
so a port in use fails the start here and no other server takes it meanwhile.

Admission is one count of inputs in flight in shared memory (frontend.InflightLimiter over shared_counts.py), so
the limit is the server's, not each front end's. Health follows the host's status: Status goes to every front end
when it changes and each second. A drain goes to every front end, which drains its own calls and says Drained. A
front end that dies is started again. Front ends are forked by the CPU workers' zygote (executor/zygote.py) where
there can be one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import socket
import tempfile
import time
from dataclasses import replace

import zmq
import zmq.asyncio

from embedserv import logs
from embedserv.call_class import CALL_CLASS, CallClass
from embedserv.config import ServerConfig
from embedserv.errors import ConfigError
from embedserv.executor import zygote
from embedserv.executor.process_worker import cpu_process_environment
from embedserv.executor.zygote import ForkedProcess
from embedserv.logs import REQUEST_ID
from embedserv.server.engine_host import EngineHost
from embedserv.server.frontend import bound_socket
from embedserv.server.link_messages import (
    CODEC,
    CancelAll,
    CancelCall,
    Drain,
    Drained,
    GenerateCall,
    GenerateDelta,
    GenerateEnd,
    Hello,
    InferCall,
    InferDone,
    Status,
    failure,
)
from embedserv.server.shared_counts import SharedCounts

logger = logging.getLogger(__name__)
_STATUS_EVERY_S = 1.0
_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
_START_TIMEOUT_S = 120.0


def reserve_port(host: str, port: int, flag: str) -> socket.socket:
    """The port bound for the server's life with SO_REUSEPORT but never listening: listeners join it, connections
    never reach it. Port 0 picks a free one."""
    try:
        sock = bound_socket(host, port, reuse_port=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); is the port in use? pick another {flag}"
        ) from None
    # Another server that shares its port (SO_REUSEPORT, same user) would let the bind pass: one that answers
    # a connection is in the way all the same.
    if _answers(host, sock.getsockname()[1]):
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} (another server answers there); is the port in use? pick another {flag}"
        )
    return sock


def _answers(host: str, port: int) -> bool:
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        socket.create_connection((target, port), timeout=1.0).close()
    except OSError:
        return False
    return True


class FrontendProcesses:
    def __init__(self, config: ServerConfig, host: EngineHost) -> None:
        self.host = host
        self._reserved = [reserve_port(config.host, config.port, "--port")]
        if config.http_port:
            self._reserved.append(reserve_port(config.host, config.http_port, "--http-port"))
        ports = [sock.getsockname()[1] for sock in self._reserved]
        self.port = ports[0]
        # Concrete ports and front-end count: every front end serves the same, whatever it would derive itself.
        self.config = replace(
            config, port=ports[0], http_port=ports[1] if config.http_port else 0, frontends=config.num_frontends
        )
        # The inputs in flight over every front end, in all and per API key (frontend.InflightLimiter's counts).
        self._dir = tempfile.TemporaryDirectory(prefix="embedserv-frontends-")
        self.in_flight = SharedCounts(os.path.join(self._dir.name, "in-flight"), 1 + len(config.all_api_keys))
        self.address = f"ipc://{self._dir.name}/engine"
        # The front ends count calls in prometheus-client's multiprocess files here; /metrics adds them up.
        self.metrics_dir = os.path.join(self._dir.name, "metrics")
        os.mkdir(self.metrics_dir)
        self._socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._frontends: dict[bytes, int] = {}
        self._started_frontends: dict[int, str] = {}  # index -> "" once listening, else why it could not
        self._drained: set[int] = set()
        # Set by drain(): a front end that says Hello after the drain began (it started late) drains too.
        self._drain: Drain | None = None
        # Set once every front end listens, cleared by a drain: while set, a front end that dies is replaced.
        self._watching = False
        self._calls: dict[tuple[bytes, int], asyncio.Task] = {}
        self._processes: dict[int, multiprocessing.Process | ForkedProcess] = {}
        self._tasks: list[asyncio.Task] = []
        self._broadcasts: set[asyncio.Task] = set()
        self._handlers = {
            Hello: self._hello, CancelCall: self._cancel, Drained: self._drained_one,
            InferCall: self._start_infer, GenerateCall: self._start_generate,
        }  # fmt: skip

    async def start(self) -> None:
        """Starts the front-end processes and waits until each listens (ConfigError if one cannot)."""
        self._tasks = [asyncio.create_task(self._receive(), name="frontends-link"),
                       asyncio.create_task(self._status_loop(), name="frontends-status")]  # fmt: skip
        for index in range(self.config.num_frontends):
            await self._spawn(index)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(self._started_frontends) < len(self._processes):
            dead = [i for i, p in self._processes.items() if not p.is_alive() and i not in self._started_frontends]
            if dead or time.monotonic() > deadline:
                raise ConfigError(f"front end {(dead or ['?'])[0]} did not start; see its log lines above")
            await asyncio.sleep(0.05)
        failed = [why for why in self._started_frontends.values() if why]
        if failed:
            raise ConfigError(failed[0])
        self._watching = True
        logger.info("%d front ends listening on %s:%d", len(self._processes), self.config.host, self.port)

    async def _spawn(self, index: int) -> None:
        """Forks the front end from the CPU workers' zygote (executor/zygote.py), which imported torch and
        transformers once, where there can be one; else starts it through multiprocessing's spawn."""
        from embedserv.server.frontend_process import run_frontend

        log_settings = (logging.getLevelName(logging.getLogger().getEffectiveLevel()), logs.current_format())
        args = (self.config, index, self.address, self.in_flight, log_settings, os.getpid())
        # The child reads its environment when it starts: the variable must be there before prometheus_client
        # is first imported in it, and must not be in this process, whose own counters stay in memory.
        env = dict(os.environ, **{_MULTIPROC_DIR: self.metrics_dir})
        process = await self._fork(run_frontend, args, env)
        if process is None:
            process = multiprocessing.get_context("spawn").Process(
                target=run_frontend, name=f"embedserv-frontend-{index}", daemon=True, args=args
            )
            previous = os.environ.get(_MULTIPROC_DIR)
            os.environ[_MULTIPROC_DIR] = self.metrics_dir
            try:
                process.start()
            finally:
                if previous is None:
                    del os.environ[_MULTIPROC_DIR]
                else:
                    os.environ[_MULTIPROC_DIR] = previous
        self._processes[index] = process
        logger.info("started front end %d (pid %d)", index, process.pid)

    async def _fork(self, target, args: tuple, env: dict[str, str]) -> ForkedProcess | None:
        try:
            forks = zygote.for_environment(cpu_process_environment(self.config.models[0].cpu_allocator))
        except ConfigError:  # the workers cannot start either, and say why
            return None
        if forks is None or not await forks.started():
            return None
        return forks.fork(target, args, env, name=zygote.FRONTEND_NAME)

    async def _send(self, identity: bytes, message: object) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._socket.send_multipart([identity, *CODEC.encode(message)], copy=False)

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self._socket.recv_multipart(copy=False)
            try:
                message = CODEC.decode(frames)
            except ValueError:
                logger.exception("a front end sent a malformed message")
                continue
            handler = self._handlers.get(type(message))
            if handler is None:
                logger.error("a front end sent %s, which only the engine host sends", type(message).__name__)
                continue
            await handler(bytes(identity), message)

    async def _hello(self, identity: bytes, hello: Hello) -> None:
        self._started_frontends[hello.index] = hello.error
        if not hello.error:
            self._frontends[identity] = hello.index
            await self._send(identity, self.status())
            if self._drain is not None:
                await self._send(identity, self._drain)

    async def _cancel(self, identity: bytes, cancel: CancelCall) -> None:
        task = self._calls.get((identity, cancel.call_id))
        if task is not None:
            task.cancel()

    async def _drained_one(self, identity: bytes, drained: Drained) -> None:
        self._drained.add(drained.index)

    async def _start_infer(self, identity: bytes, call: InferCall) -> None:
        self._track((identity, call.call_id), self._infer(identity, call))

    async def _start_generate(self, identity: bytes, call: GenerateCall) -> None:
        self._track((identity, call.call_id), self._generate(identity, call))

    def _track(self, key: tuple[bytes, int], run) -> None:
        """A call runs in a task of its own, which CancelCall (or its front end's death) cancels."""
        task = asyncio.create_task(run)
        self._calls[key] = task
        task.add_done_callback(lambda _: self._calls.pop(key, None))

    async def _infer(self, identity: bytes, call: InferCall) -> None:
        REQUEST_ID.set(call.request_id)  # this task's own context
        CALL_CLASS.set(CallClass(call.priority, call.tenant))
        try:
            core = self.host.cores[call.model]
            outputs, tokens, timing = await core.infer(call.sequences, call.received, call.wanted, call.use_cache)
            # The front end's trace rebuilds its run from the outputs it gets: they cross once.
            reply = InferDone(call.call_id, outputs, tokens, replace(timing, runs=()))
        except asyncio.CancelledError:
            return
        except Exception as exc:
            reply = failure(call.call_id, exc)
        await self._send(identity, reply)

    async def _generate(self, identity: bytes, call: GenerateCall) -> None:
        REQUEST_ID.set(call.request_id)
        CALL_CLASS.set(CallClass(call.priority, call.tenant))
        try:
            core = self.host.cores[call.model]
            deltas = core.generate(call.prompt, call.params, call.decoder_prompt, call.add_special_tokens, call.stream)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    await self._send(identity, GenerateDelta(call.call_id, delta))
            reply = GenerateEnd(call.call_id)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            reply = failure(call.call_id, exc)
        await self._send(identity, reply)

    def status(self) -> Status:
        host = self.host.status()
        return Status(host.started, host.models)

    async def broadcast(self, message: object) -> None:
        for identity in list(self._frontends):
            await self._send(identity, message)

    def status_changed(self) -> None:
        """The host's status changed: every front end hears it now (not at the next second)."""
        task = asyncio.create_task(self.broadcast(self.status()))
        self._broadcasts.add(task)
        task.add_done_callback(self._broadcasts.discard)

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATUS_EVERY_S)
            try:
                await self.broadcast(self.status())
                await self._replace_dead_frontends()
            except Exception:
                logger.exception("front-end status update failed")

    async def _replace_dead_frontends(self) -> None:
        for index, process in list(self._processes.items()):
            if self._watching and not process.is_alive():
                logger.error("front end %d (pid %d) exited with %s; starting it again", index, process.pid,
                             process.exitcode)  # fmt: skip
                self._forget(index)
                await self._spawn(index)

    def _forget(self, index: int) -> None:
        self._started_frontends.pop(index, None)
        for identity, known in list(self._frontends.items()):
            if known == index:
                del self._frontends[identity]
                for key in [key for key in self._calls if key[0] == identity]:
                    self._calls[key].cancel()

    async def drain(self, grace: float | None) -> None:
        """Every front end drains its own calls (up to `grace` seconds), then this waits for their Drained."""
        self._watching = False
        self._drain = Drain(grace or 0.0)
        await self.broadcast(self._drain)
        deadline = time.monotonic() + (grace or 0.0) + 5.0
        while self._undrained() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _undrained(self) -> list[int]:
        """Front ends that said Hello or whose process is alive, not yet drained: one still starting says Hello
        after the drain began and drains then (`_hello`); stopping without it would leave it serving until killed."""
        alive = {i for i, process in self._processes.items() if process.is_alive()}
        return sorted((alive | set(self._frontends.values())) - self._drained)

    async def cancel_calls(self) -> None:
        await self.broadcast(CancelAll())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in list(self._calls.values()):
            task.cancel()
        self._watching = False
        for process in self._processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._socket.close(linger=0)
        for sock in self._reserved:
            sock.close()
        self.in_flight.close()
        self._dir.cleanup()
