"""A stream whose client goes away while the handler is at a yield is closed by gRPC (GeneratorExit), not
cancelled: it is counted CANCELLED all the same (server/calls.py). It used to go uncounted, so a cancelled
Generate stream showed in /metrics or not by where the cancel caught it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from embedserv import metrics
from embedserv.api_keys import KeyTable
from embedserv.server.calls import stream_call
from embedserv.server.frontend import ActiveCalls


class _Context:
    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def time_remaining(self):
        return None


class _Servicer:
    rpc_prefix = "test."

    def __init__(self) -> None:
        self.active_calls = ActiveCalls()
        self.frontend = SimpleNamespace(keys=KeyTable((), 1))

    @stream_call
    async def Forever(self, request, context, call):
        while True:
            yield "part"
            await asyncio.sleep(0)


def _cancelled() -> float:
    return metrics.REQUESTS.labels("grpc", "test.Forever", "", "CANCELLED")._value.get()


def test_a_stream_closed_at_its_yield_counts_cancelled():
    async def run() -> None:
        servicer = _Servicer()
        stream = servicer.Forever(None, _Context())
        assert await stream.__anext__() == "part"
        await stream.aclose()  # what gRPC does when the client goes away while the handler is at a yield
        assert servicer.active_calls.count == 0

    before = _cancelled()
    asyncio.run(run())
    assert _cancelled() - before == 1
