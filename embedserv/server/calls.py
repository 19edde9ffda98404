"""One call from start to end: its request id, the status it ends with, its metrics and its log line.

`Call` is the same for every protocol (the HTTP face makes its own in http/edge.py). gRPC handlers are wrapped by
`unary_call` or `stream_call`. The wrapper gives the call an id (the client's `x-request-id` metadata, or a new
one), returns it as trailing metadata `x-request-id`, and turns every way a call can end into one status code: OK,
an embedserv error's code, INTERNAL for a bug (logged with its traceback), and CANCELLED or DEADLINE_EXCEEDED when
gRPC cancels the handler because the client went away or its deadline passed. The server never dies on a request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid

import grpc

from embedserv import metrics, tracing
from embedserv.call_class import CALL_CLASS, PRIORITY_HEADER, CallClass, checked_priority, set_priority
from embedserv.errors import RETRY_AFTER_S
from embedserv.logs import REQUEST_ID
from embedserv.server.grpc.status import message_for, status_for
from embedserv.types import Timing

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


# gRPC codes a server span counts as its own error (OpenTelemetry's RPC conventions); the rest are the caller's.
_GRPC_SERVER_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)


def _ms(us: int) -> int:
    return max(0, us // 1000)


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
        self.method = ""  # HTTP's
        self.received = time.perf_counter()
        # The engine's measured timing (several answered parts: each part as long as the longest); None for
        # calls without a compute step.
        self.timing: Timing | None = None
        # The call's spans while tracing is on (start_trace), else None.
        self.trace: tracing.CallTrace | None = None

    def start_trace(self, name: str, carrier: dict[str, str], attributes: dict) -> None:
        """Opens the call's server span (called while tracing is on: tracing.active); `carrier` holds the
        incoming headers."""
        attributes = {**attributes, "embedserv.request_id": self.request_id}
        self.trace = tracing.start(name, self.received, carrier, attributes)

    def answered(self, inputs: int, tokens: int, timing: Timing | None = None) -> None:
        """A part of the call answered (all of it, or one request of a stream): its inputs, the tokens they
        took and, where the engine ran, its timing (the call's timing headers, metrics and trace)."""
        self.inputs += inputs
        self.tokens += tokens
        metrics.INPUTS.labels(self.protocol, self.rpc, self.model).inc(inputs)
        metrics.INPUT_TOKENS.labels(self.protocol, self.rpc, self.model).inc(tokens)
        if timing is not None:
            self.timing = timing if self.timing is None else Timing.longest([self.timing, timing])
            if self.trace is not None:
                for run in timing.runs:
                    self.trace.engine_ran(run)
            metrics.QUEUE_SECONDS.labels(self.rpc, self.model).observe(timing.queue_us / 1e6)
            metrics.TOKENIZATION_SECONDS.labels(self.rpc, self.model).observe(timing.tokenization_us / 1e6)
            metrics.INFERENCE_SECONDS.labels(self.rpc, self.model).observe(timing.inference_us / 1e6)
        if self.trace is not None:
            self.trace.answered_at = time.perf_counter()

    def timing_fields(self, now: float) -> list[tuple[str, str]]:
        """TEI's timing headers (milliseconds, as TEI sends them) as of `now`: what the call measured.

        Consistent by construction: tokenization + queue + inference <= total, each >= 0 (the engine's parts
        lie inside the call's wall time; the caps only matter for parts that ran at once)."""
        total = max(0, int((now - self.received) * 1e3))
        fields = [("x-compute-time", str(total)), ("x-total-time", str(total))]
        if self.tokens:
            fields.append(("x-compute-tokens", str(self.tokens)))
        if self.timing is not None:
            queue = min(_ms(self.timing.queue_us), total)
            inference = min(_ms(self.timing.inference_us), total - queue)
            tokenization = min(_ms(self.timing.tokenization_us), total - queue - inference)
            fields += [
                ("x-tokenization-time", str(tokenization)),
                ("x-queue-time", str(queue)),
                ("x-inference-time", str(inference)),
            ]
        return fields

    def end(self, status: str) -> None:
        metrics.REQUESTS.labels(self.protocol, self.rpc, self.model, status).inc()
        if self.trace is not None:
            self._end_trace(status)
        logger.debug(
            "request %s: %s %s model=%s inputs=%d tokens=%d status=%s in %.1f ms",
            self.request_id,
            self.protocol,
            self.rpc,
            self.model or "-",
            self.inputs,
            self.tokens,
            status,
            (time.perf_counter() - self.received) * 1e3,
        )

    def _end_trace(self, status: str) -> None:
        attributes: dict[str, object] = {
            "embedserv.model": self.model,
            "embedserv.inputs": self.inputs,
            "embedserv.tokens": self.tokens,
        }
        if self.protocol == "http":
            code = int(status) if status.isdigit() else 0
            attributes.update({"http.response.status_code": code, "http.route": self.rpc})
            # Named like the route (OpenTelemetry's HTTP conventions), known only once it has run.
            self.trace.span.update_name(f"{self.method} {self.rpc}")
            error = f"HTTP {code}" if code >= 500 or code == 0 else None
        else:
            code = grpc.StatusCode.__members__.get(status, grpc.StatusCode.UNKNOWN)
            attributes["rpc.grpc.status_code"] = code.value[0]
            error = status if status in _GRPC_SERVER_ERRORS else None
        self.trace.end(attributes, error, time.perf_counter())
        self.trace = None


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
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # HTTP's Retry-After as metadata, for clients that honour it (ours backs off on its own).
        context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id), ("retry-after", str(RETRY_AFTER_S))))
    await context.abort(code, message_for(exc, call.rpc))


def _start(rpc: str, context: grpc.aio.ServicerContext) -> Call:
    call = Call("grpc", rpc, request_id_or_new(metadata_value(context, REQUEST_ID_KEY)))
    # Each RPC runs in its own task, so this is the call's id for everything it awaits (batch log lines).
    REQUEST_ID.set(call.request_id)
    context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id),))
    if tracing.active:
        call.start_trace(rpc, dict(context.invocation_metadata() or ()), {"rpc.system": "grpc", "rpc.method": rpc})
    return call


def priority_field(request) -> bool:
    """Sets the call's priority from a request message's `priority` field; False if it has none set."""
    if request is None or not hasattr(request, "priority") or not request.HasField("priority"):
        return False
    set_priority(checked_priority(request.priority, "priority"))
    return True


def _classify(servicer, request, context: grpc.aio.ServicerContext) -> None:
    """The call's class (call_class.py): its API key's tenant and default priority (the interceptor let only
    known keys through), then the request's `priority` field where it has one set, else the x-priority metadata
    (TEI's messages have no such field)."""
    keys = servicer.frontend.keys
    if keys:
        key = keys.match(metadata_value(context, "authorization"), "metadata")[0]
        if key is not None:
            CALL_CLASS.set(CallClass(key.priority, key.name))
    if priority_field(request):
        return
    value = metadata_value(context, PRIORITY_HEADER)
    if value is not None:
        set_priority(checked_priority(value, f"metadata {PRIORITY_HEADER}"))


def _end_ok(call: Call, context: grpc.aio.ServicerContext) -> None:
    """The call's id and its timing (TEI's header names) as trailing metadata, then its end counted."""
    context.set_trailing_metadata(((REQUEST_ID_KEY, call.request_id), *call.timing_fields(time.perf_counter())))
    call.end(grpc.StatusCode.OK.name)


def unary_call(handler):
    """Wraps `handler(self, request, context, call)` of a unary-response RPC (`self.active_calls` counts it;
    the metrics' rpc label is `self.rpc_prefix` + the handler's name)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        call = _start(self.rpc_prefix + handler.__name__, context)
        self.active_calls.enter()
        try:
            _classify(self, request, context)
            response = await handler(self, request, context, call)
        except BaseException as exc:
            await _end_with_error(call, context, exc)
        finally:
            self.active_calls.exit()
        _end_ok(call, context)
        return response

    return wrapper


def stream_call(handler):
    """The same for handlers that yield responses."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        call = _start(self.rpc_prefix + handler.__name__, context)
        self.active_calls.enter()
        try:
            _classify(self, request, context)
            async for response in handler(self, request, context, call):
                yield response
        except BaseException as exc:
            await _end_with_error(call, context, exc)
        finally:
            self.active_calls.exit()
        _end_ok(call, context)

    return wrapper
