"""The front end's drain, in process and without a model: gRPC's server is stopped once, new calls are refused
with UNAVAILABLE (HTTP: 503 with Retry-After) while calls in flight finish, and health answers NOT_SERVING until
the end.

grpcio's aio server must be stopped once: a second stop racing the first crashed the process (SIGSEGV) when the
drain's timeout and gRPC's own grace ran out together (tests/e2e/test_drain.py, 1 run in 12)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedserv.server.frontend import InflightLimiter
from embedserv.server.frontend_server import FrontendServer
from tests.helpers.client import embed_request, inference_stub
from tests.helpers.configs import serve_config
from tests.helpers.server import free_port


class _StopSpy:
    """Wraps the gRPC server's stop: how many ran at once, at most, and how many ran."""

    def __init__(self, server: FrontendServer) -> None:
        self.running = self.most = self.calls = 0
        stop = server.server.stop

        async def spied(grace):
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await stop(grace)
            finally:
                self.running -= 1

        server.server.stop = spied


async def _server(tmp_path, bundled_dir, http_port: int = 0) -> FrontendServer:
    args = ["--model", str(bundled_dir), "--port", "0", "--http-port", str(http_port)]
    config = serve_config(tmp_path, args)
    server = FrontendServer(config, InflightLimiter.for_config(config))
    await server.listen()
    return server


async def _open_watch(channel: grpc.aio.Channel):
    """A health Watch stream that has seen its first status (it never ends on its own)."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    await watch.read()
    return watch


@pytest.mark.parametrize("grace", [0.2, 0.0, None])
def test_the_drain_stops_grpc_once_when_calls_outlive_it(tmp_path, bundled_dir, grace):
    asyncio.run(_drain_past_a_call(tmp_path, bundled_dir, grace))


async def _drain_past_a_call(tmp_path, bundled_dir, grace) -> None:
    server = await _server(tmp_path, bundled_dir)
    spy = _StopSpy(server)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        watch = await _open_watch(channel)
        server.frontend.active_calls.enter()  # a call that runs past the grace
        await server.drain(grace)
        assert (spy.calls, spy.most) == (1, 1)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                await watch.read()
        # The Watch stream did not hold the drain: it was cancelled at its end (retryable for the client).
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE


def test_a_second_signal_and_the_drain_share_one_stop(tmp_path, bundled_dir):
    asyncio.run(_second_signal(tmp_path, bundled_dir))


async def _second_signal(tmp_path, bundled_dir) -> None:
    server = await _server(tmp_path, bundled_dir)
    spy = _StopSpy(server)
    server.frontend.active_calls.enter()
    drain = asyncio.create_task(server.drain(0.5))
    await asyncio.sleep(0.1)
    await server.cancel_calls()
    await asyncio.wait_for(drain, 5)
    assert (spy.calls, spy.most) == (1, 1)


def test_while_draining_new_calls_are_refused_unavailable_and_health_answers(tmp_path, bundled_dir):
    asyncio.run(_call_while_draining(tmp_path, bundled_dir))


async def _call_while_draining(tmp_path, bundled_dir) -> None:
    http_port = free_port()
    server = await _server(tmp_path, bundled_dir, http_port)
    server.frontend.active_calls.enter()
    drain = asyncio.create_task(server.drain(30))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            while not server.frontend.draining:
                await asyncio.sleep(0.01)
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await inference_stub(channel).Embed(embed_request(["late"]), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            assert dict(refused.value.trailing_metadata()).get("retry-after") == "1"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as client:
            reply = await client.post("/v1/embeddings", json={"input": "late"})
            assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"]
            assert int(reply.headers["retry-after"]) >= 1  # retryable, and a client knows when
        assert not drain.done()  # the call in flight still holds the drain
    finally:
        server.frontend.active_calls.exit()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain, 5)
    assert drain.done()


class _Alive:
    def __init__(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive


def test_the_engine_host_waits_for_a_front_end_still_starting_to_drain_too():
    """A SIGTERM just after front end 0 listens, front end 1 still starting: the drain waits for front end 1's
    Hello and Drained too. It used to end with front end 0's, so front end 1 got no Drain, served on, and the
    stop waited 5 s for it before killing it."""
    from embedserv.server.frontends import FrontendProcesses
    from embedserv.server.link_messages import Drained, Hello

    pool = object.__new__(FrontendProcesses)
    pool._processes = {0: _Alive(), 1: _Alive()}
    pool._frontends, pool._started_frontends, pool._drained = {b"fe0": 0}, {}, set()
    pool._drain, pool._watching = None, True
    sent: list[tuple[bytes, object]] = []

    async def send(identity, message):
        sent.append((identity, message))
        if identity == b"fe0":
            await pool._drained_one(identity, Drained(0))

    pool._send = send
    pool.status = lambda: "status"

    async def late_front_end():
        await asyncio.sleep(0.3)
        await pool._hello(b"fe1", Hello(1, 1234))
        await asyncio.sleep(0.1)
        await pool._drained_one(b"fe1", Drained(1))

    async def run():
        late = asyncio.create_task(late_front_end())
        await pool.drain(30)
        assert late.done()
        await late

    asyncio.run(run())
    assert pool._drained == {0, 1}
    assert [identity for identity, message in sent if type(message).__name__ == "Drain"] == [b"fe0", b"fe1"]
    # A front end that died while starting is not waited for.
    pool._processes[2], pool._drained = _Alive(), {0, 1}
    pool._processes[2].alive = False
    asyncio.run(asyncio.wait_for(pool.drain(30), 2))
