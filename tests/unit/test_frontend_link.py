"""The pieces of `--frontends N` that need no server: the link's messages, the shared admission count, and how
many front ends `--frontends 0` starts (server/link_messages.py, server/frontend.py, config.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from embedserv.config import ModelConfig, ServerConfig, bundled_model_path, frontends_for_cores, usable_cores
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import SequenceOutput
from embedserv.errors import ConfigError, InvalidInput, NotReady, Overloaded
from embedserv.server.frontend import InflightLimiter
from embedserv.server.link_messages import CODEC, InferCall, InferDone, error_of, failure
from embedserv.types import EmbedOutput, Timing


def test_calls_and_answers_cross_the_link_intact():
    sequences = [InputSequence([101, 7, 102]), InputSequence([101, 102], 1, [0, 0], 2)]
    call = InferCall(7, "minilm", sequences, 12.5, (EmbedOutput.SPARSE,), "req-1")
    assert CODEC.decode(CODEC.encode(call)) == call
    assert call.use_cache and not CODEC.decode(CODEC.encode(dataclasses.replace(call, use_cache=False))).use_cache
    output = SequenceOutput(np.arange(4, dtype=np.float32), 1.0, 2.0, sparse=(np.ones(2, np.float32), np.array([3, 9])))
    done = InferDone(7, [output], 3, Timing(1, 2, 3, 4))
    back = CODEC.decode(CODEC.encode(done))
    np.testing.assert_array_equal(back.outputs[0].row, done.outputs[0].row)
    np.testing.assert_array_equal(back.outputs[0].sparse[1], [3, 9])
    assert (back.tokens, back.timing) == (3, Timing(1, 2, 3, 4))


@pytest.mark.parametrize("error", [InvalidInput("too long"), NotReady("loading"), Overloaded("full")])
def test_an_engine_error_is_raised_again_at_the_front_end_as_itself(error):
    failed = CODEC.decode(CODEC.encode(failure(3, error)))
    again = error_of(failed)
    assert type(again) is type(error) and str(again) == str(error)


def test_an_unexpected_engine_error_is_internal_and_says_what_it_was():
    again = error_of(failure(3, KeyError("x")))
    assert type(again) is RuntimeError and "KeyError" in str(again)


def test_the_shared_count_admits_for_the_whole_server():
    shared = multiprocessing.get_context("spawn").Array("q", 1)
    first, second = InflightLimiter(10, shared), InflightLimiter(10, shared)
    with first.hold(6):
        assert second.in_flight == 6
        with pytest.raises(Overloaded, match="limit of 10 inputs in flight \\(6 now\\)"):
            with second.hold(5):
                pass
        with second.hold(4):
            assert first.in_flight == 10
    assert first.in_flight == second.in_flight == 0


def test_frontends_zero_means_one_per_four_cores(tmp_path):
    assert [frontends_for_cores(n) for n in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 8]
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")
    unlimited = usable_cores(str(limit))
    limit.write_text("150000 100000\n")
    assert usable_cores(str(limit)) == 1
    assert usable_cores(str(tmp_path / "none")) == unlimited


@pytest.mark.parametrize("frontends", [-1, 65])
def test_frontends_out_of_range_is_refused(frontends):
    model = ModelConfig(path=str(bundled_model_path()), served_name="m")
    with pytest.raises(ConfigError, match="--frontends must be in 0..64"):
        ServerConfig(models=(model,), frontends=frontends)


def test_a_front_end_that_says_hello_after_the_drain_began_is_told_to_drain_too(monkeypatch):
    """A SIGTERM just after the first front end listens, before the second: the late one must drain too, or
    the engine host waits out its drain deadline for a Drained that never comes (and gets SIGKILLed)."""
    from embedserv.server.engine_host import EngineHost
    from embedserv.server.frontends import FrontendProcesses
    from embedserv.server.link_messages import Drain, Drained, Hello, Status
    from embedserv.server.remote_core import FrontendLink

    async def no_spawn(self, index: int) -> None:  # the front ends are this test's
        pass

    monkeypatch.setattr(FrontendProcesses, "_spawn", no_spawn)

    def front_end(address: str, index: int, drains: list) -> FrontendLink:
        async def drained() -> None:
            await asyncio.sleep(0.5)  # its calls in flight finishing
            await link.send(Drained(index))

        def drain(message: Drain) -> None:
            drains.append(message)
            tasks.add(asyncio.get_running_loop().create_task(drained()))

        link = FrontendLink(address, index, {Status: lambda status: None, Drain: drain})
        return link

    tasks: set[asyncio.Task] = set()

    async def run() -> tuple[list, list]:
        model = ModelConfig(path=str(bundled_model_path()), served_name="m")
        config = ServerConfig(models=(model,), frontends=2, port=0, http_port=0)
        frontends = FrontendProcesses(config, EngineHost(config))
        await frontends.start()
        first_drains, late_drains = [], []
        first = front_end(frontends.address, 0, first_drains)
        await first.start(Hello(0, 1))
        await asyncio.sleep(0.2)  # the host knows the first front end
        drain = asyncio.create_task(frontends.drain(0.0))
        await asyncio.sleep(0.1)  # the drain went out to the first one only, which is still draining
        late = front_end(frontends.address, 1, late_drains)
        await late.start(Hello(1, 2))
        try:
            await asyncio.wait_for(drain, timeout=3.0)  # its own deadline is 5 s
        finally:
            first.close()
            late.close()
            await frontends.stop()
        return first_drains, late_drains

    first_drains, late_drains = asyncio.run(run())
    assert first_drains == late_drains == [Drain(0.0)]


def test_what_a_front_end_says_last_reaches_the_host_though_its_process_ends_at_once(tmp_path):
    """A forked front end ends with os._exit as soon as it returns (executor/zygote.py), and zmq sends from a thread
    of its own: Drained was lost now and then, and the host waited out its drain deadline (a second signal's exit
    took over 60 s in CI). Closing the link waits for what it sent."""
    import zmq

    from embedserv.server.link_messages import Hello
    from embedserv.server.remote_core import FrontendLink

    address = f"ipc://{tmp_path}/engine"
    context = zmq.Context()
    host = context.socket(zmq.ROUTER)
    host.bind(address)
    last_words = "x" * (32 << 20)  # large enough that sending it takes a while
    pid = os.fork()
    if pid == 0:
        code = 1
        try:

            async def speak() -> None:
                link = FrontendLink(address, 0, {})
                await link.send(Hello(0, os.getpid(), last_words))
                link.close(linger_ms=20_000)

            asyncio.run(speak())
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 60  # a child that hung (it forked from a process with threads) fails, not hangs
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if ended[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked front end did not exit within 60 s")
        assert os.waitstatus_to_exitcode(ended[1]) == 0
        assert host.poll(10_000), "the front end's last message never arrived"
        _, *frames = host.recv_multipart()
        assert CODEC.decode(frames).error == last_words
    finally:
        context.destroy(linger=0)


def _spawn_a_front_end_and_die(pids) -> None:
    """An engine host's side: start front end 0 as the server does, then die before it has finished importing."""
    from embedserv.server.engine_host import EngineHost
    from embedserv.server.frontends import FrontendProcesses

    model = ModelConfig(path=str(bundled_model_path()), served_name="m")
    config = ServerConfig(models=(model,), frontends=2, port=0, http_port=0)
    frontends = FrontendProcesses(config, EngineHost(config))
    asyncio.run(frontends._spawn(0))
    pids.put(frontends._processes[0].pid)
    pids.close()
    pids.join_thread()  # the pid is sent before this process dies without cleaning up
    os._exit(0)


@pytest.mark.parametrize("zygote", ["1", "0"], ids=["forked", "spawned"])
def test_a_front_end_whose_engine_host_died_while_it_started_exits(zygote, monkeypatch):
    """An engine host killed while its front end still starts (spawned: still imports): the front end, reparented
    before it could look, must not take its new parent for the host (it would serve on, orphaned, for ever)."""
    from tests.helpers.processes import is_alive, wait_for

    monkeypatch.setenv("EMBEDSERV_WORKER_ZYGOTE", zygote)

    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    host = context.Process(target=_spawn_a_front_end_and_die, args=(pids,))
    host.start()
    frontend = pids.get(timeout=60)
    host.join(timeout=60)
    try:
        wait_for(lambda: not is_alive(frontend), 60, what="the orphaned front end gone")
    finally:
        if is_alive(frontend):
            os.kill(frontend, signal.SIGKILL)
