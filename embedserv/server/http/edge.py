"""The HTTP edge: what every HTTP request goes through before and after its route, as gRPC's interceptor
and call wrappers do for RPCs.

In order: a request id (the client's `x-request-id`, or a new one, returned on every response); 503 once a
drain has begun; the API key (`Authorization: Bearer`; health, /metrics and the docs stay open); 413 for a body past
the server's limit (by Content-Length, or counted as it arrives); then the route, counted among the calls a
drain waits for until its last byte (a server-sent-event stream included), and in the metrics with
protocol "http", the route's path and the HTTP status. An exception a route lets out has been answered
(500) by then; it is logged here once, with the request id, and goes no further.
"""

from __future__ import annotations

import logging
import time

from starlette.requests import Request

from embedserv import tracing
from embedserv.call_class import CALL_CLASS, PRIORITY_HEADER, CallClass, checked_priority, set_priority
from embedserv.errors import InvalidInput
from embedserv.logs import REQUEST_ID
from embedserv.server.calls import Call, request_id_or_new
from embedserv.server.frontend import Frontend
from embedserv.server.http.error_responses import BodyTooLarge, error_response, error_style, exception_response

logger = logging.getLogger("embedserv.server.http")

# Open without an API key and never refused while draining (probes and scrapers call them).
HEALTH_PATHS = frozenset({"/health", "/ping", "/metrics"})
OPEN_PREFIXES = ("/docs", "/openapi.json")
_REQUEST_ID = b"x-request-id"
_PRIORITY = PRIORITY_HEADER.encode()
_EVENT_STREAM = b"text/event-stream"


def _timing_headers(call: Call, headers) -> list[tuple[bytes, bytes]]:
    """TEI's timing headers for a successful response, measured up to its start. A server-sent-event stream
    starts before any compute, so it carries none (its trace and the metrics have its timing)."""
    for key, value in headers:
        if key.lower() == b"content-type" and value.startswith(_EVENT_STREAM):
            return []
    return [(name.encode(), value.encode()) for name, value in call.timing_fields(time.perf_counter())]


def _carrier(scope) -> dict[str, str]:
    """The request's headers for the trace context propagators (traceparent, tracestate, baggage)."""
    return {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", ())}


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class Edge:
    def __init__(self, app, frontend: Frontend) -> None:
        self.app = app
        self.frontend = frontend
        self._keys = frontend.keys
        self.max_body_bytes = frontend.receive_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        request_id = request_id_or_new(_header(scope, _REQUEST_ID))
        REQUEST_ID.set(request_id)
        call = Call("http", "other", request_id)
        scope.setdefault("state", {})["call"] = call
        call.method = scope.get("method", "")
        probe = path in HEALTH_PATHS or path.startswith(OPEN_PREFIXES)
        if not probe:  # probes and the docs are not traced
            attributes = {"http.request.method": call.method, "url.path": path}
            if tracing.active:
                call.start_trace(call.method, _carrier(scope), attributes)
        status = 0

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (_REQUEST_ID, request_id.encode())]
                if 200 <= status < 300:
                    headers += _timing_headers(call, headers)
                message = {**message, "headers": headers}
            await send(message)

        refusal = self._refusal(scope, path)
        if refusal is not None:
            await error_response(*refusal)(scope, receive, send_with_id)
            call.rpc = path if path in HEALTH_PATHS else "refused"
            call.end(str(status))
            return
        if probe:
            await self.app(scope, receive, send_with_id)
            return
        self.frontend.active_calls.enter()
        try:
            await self.app(scope, self._limited(receive), send_with_id)
        except Exception:
            logger.exception("request %s: %s %s failed", request_id, scope.get("method"), path)
            if status == 0:
                await exception_response(Request(scope), RuntimeError("unexpected error"))(scope, receive, send_with_id)
        finally:
            self.frontend.active_calls.exit()
            route = scope.get("route")
            call.rpc = getattr(route, "path", None) or "unmatched"
            call.end(str(status))

    def _refusal(self, scope, path: str) -> tuple[str, int, str] | None:
        """(style, status, message) when the request is refused before its route runs, else None. The checks that
        read the caller also set the call's class (call_class.py): its key's tenant and priority, then x-priority."""
        style = error_style(Request(scope))
        open_path = path in HEALTH_PATHS or path.startswith(OPEN_PREFIXES)
        if self.frontend.draining and path not in HEALTH_PATHS:
            return style, 503, "the server is shutting down; retry on another replica"
        if self._keys and not open_path:
            key, problem = self._keys.match(_header(scope, b"authorization"), "header")
            if key is None:
                return style, 401, str(problem)
            # The key's tenant and default priority; a header or body priority overrides the latter.
            CALL_CLASS.set(CallClass(key.priority, key.name))
        priority = _header(scope, _PRIORITY)
        if priority is not None and not open_path:
            try:
                set_priority(checked_priority(priority, f"header {PRIORITY_HEADER}"))
            except InvalidInput as exc:
                return style, 400, str(exc)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return style, 413, self._too_large(int(length))
        return None

    def _too_large(self, size: int) -> str:
        return (
            f"the request body has {size} bytes, more than this server's limit of {self.max_body_bytes} "
            "(from --max-client-batch-size and --max-input-chars); send fewer or shorter inputs per call"
        )

    def _limited(self, receive):
        """`receive` that raises BodyTooLarge once a body without a Content-Length grows past the limit."""
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self._too_large(seen))
            return message

        return limited
