"""One call from start to end: its request id, the status it ends with, its metrics and its log line.

`Call` is the same for every protocol (the HTTP face makes its own in http/edge.py). gRPC handlers are wrapped by `unary_call` or `stream_call`. The wrapper gives the call an id (the client's
`x-request-id` metadata, or a new one), returns it as trailing metadata `x-request-id`, and turns every
way a call can end into one status code: OK, an embedserv error's code, INTERNAL for a bug (logged with
its traceback), and CANCELLED or DEADLINE_EXCEEDED when gRPC cancels the handler because the client
went away or its deadline passed. The server never dies on a request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import grpc

from embedserv import metrics
from embedserv.types import Timing
from embedserv.logs import REQUEST_ID
from embedserv.server.grpc.status import message_for, status_for

logger = logging.getLogger("embedserv.server.calls")

REQUEST_ID_KEY = "x-request-id"
_MAX_REQUEST_ID_CHARS = 128


def request_id_or_new(value: object) -> str:
    """The client's request id if it is a short printable ASCII string, else a new one."""
    if isinstance(value, str) and 0 < len(value) <= _MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return uuid.uuid4().hex[:16]


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    """The first value of an invocation metadata key, or None."""
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value
    return None


# A client's deadline ends on its own clock first: it resets the stream, and the reset reaches us while our
# copy of the deadline (started when the call arrived) still has the transit time left, up to a second on
# a loaded machine (seen: 5 of 5 expired calls counted CANCELLED otherwise).
_DEADLINE_SKEW_S = 1.0


def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call cancelled at (or within the skew of) its deadline, else CANCELLED."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= _DEADLINE_SKEW_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class Call:
    """What one call did, counted as it happens: a stream's answered parts count even if a later part fails.

    `protocol` is grpc or http; `rpc` the RPC or route name; the status it ends with is the protocol's
    own (a gRPC code name, an HTTP status number)."""

    def __init__(self, protocol: str, rpc: str, request_id: str) -> None:
        self.protocol = protocol
        self.rpc = rpc
        self.request_id = request_id
        # The served model's name once the request named one that exists ("" before: no client-made labels).
        self.model = ""
        self.inputs = 0
        self.tokens = 0
        self.received = time.perf_counter()

    def answered(self, inputs: int, tokens: int, timing: Timing | None = None) -> None:
        self.inputs += inputs
        self.tokens += tokens
        metrics.INPUTS.labels(self.protocol, self.rpc, self.model).inc(inputs)
        metrics.INPUT_TOKENS.labels(self.protocol, self.rpc, self.model).inc(tokens)
        if timing is not None:
            metrics.QUEUE_SECONDS.labels(self.rpc, self.model).observe(timing.queue_us / 1e6)
            metrics.TOKENIZATION_SECONDS.labels(self.rpc, self.model).observe(timing.tokenization_us / 1e6)
            metrics.INFERENCE_SECONDS.labels(self.rpc, self.model).observe(timing.inference_us / 1e6)

    def end(self, status: str) -> None:
        metrics.REQUESTS.labels(self.protocol, self.rpc, self.model, status).inc()
        logger.debug(
            "request %s: %s %s model=%s inputs=%d tokens=%d status=%s in %.1f ms", self.request_id, self.protocol,
            self.rpc, self.model or "-", self.inputs, self.tokens, status, (time.perf_counter() - self.received) * 1e3,
        )


async def _end_with_error(call: Call, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Counts and logs the call's end, then aborts with the error's status (or lets a cancel through).

    A stream's client that goes away while the handler waits cancels it (CancelledError); while it is at a
    `yield`, gRPC closes the generator instead (GeneratorExit). Both are the same cancel and count alike."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        call.end(_cancel_code(context).name)
        raise exc
    if isinstance(exc, grpc.aio.AbortError) or not isinstance(exc, Exception):
        raise exc
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("request %s: %s failed", call.request_id, call.rpc)
    call.end(code.name)
    await context.abort(code, message_for(exc, call.rpc))


def _start(rpc: str, context: grpc.aio.ServicerContext) -> Call:
    call = Call("grpc", rpc, request_id_or_new(metadata_value(context, REQUEST_ID_KEY)))
    # Each RPC runs in its own task, so this is the call's id for everything it awaits (batch log lines).
    REQUEST_ID.set(call.request_id)
    context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id),))
    return call


def unary_call(handler):
    """Wraps `handler(self, request, context, call)` of a unary-response RPC (`self.active_calls` counts it;
    the metrics' rpc label is `self.rpc_prefix` + the handler's name)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        call = _start(self.rpc_prefix + handler.__name__, context)
        self.active_calls.enter()
        try:
            response = await handler(self, request, context, call)
        except BaseException as exc:  # noqa: BLE001 - every end becomes a status, never a crash
            await _end_with_error(call, context, exc)
        finally:
            self.active_calls.exit()
        call.end(grpc.StatusCode.OK.name)
        return response

    return wrapper


def stream_call(handler):
    """The same for handlers that yield responses."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        call = _start(self.rpc_prefix + handler.__name__, context)
        self.active_calls.enter()
        try:
            async for response in handler(self, request, context, call):
                yield response
        except BaseException as exc:  # noqa: BLE001
            await _end_with_error(call, context, exc)
        finally:
            self.active_calls.exit()
        call.end(grpc.StatusCode.OK.name)

    return wrapper
