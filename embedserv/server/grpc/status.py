"""Maps engine errors to gRPC status codes; nothing a request does may take the server down. Also what refuses a
call before its handler runs: the drain here, API keys in server/security.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from embedserv import metrics
from embedserv.errors import (
    RETRY_AFTER_S,
    AdapterNotFound,
    EmbedservError,
    InvalidInput,
    ModelNotFound,
    NotReady,
    Overloaded,
)

if TYPE_CHECKING:
    from embedserv.server.frontend import Frontend

# Kubernetes probes and load balancers call health without credentials, and while the server drains.
HEALTH_PREFIX = "/grpc.health.v1.Health/"

_CODES: dict[type[EmbedservError], grpc.StatusCode] = {
    # The model is served; the request's adapter is what is wrong.
    AdapterNotFound: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: Exception) -> grpc.StatusCode:
    """The code a failed call ends with: ours for embedserv errors, INTERNAL for anything else."""
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


def message_for(exc: Exception, rpc: str) -> str:
    if isinstance(exc, EmbedservError):
        return str(exc)
    return f"{rpc} failed inside the server: {exc}"


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """While the front end drains, every RPC but health is refused with UNAVAILABLE (retryable: another replica
    serves it). gRPC's own server stops only at the drain's end: stopping it twice races (FrontendServer.drain)."""

    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if not self._frontend.draining or handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        return refusing(handler, method, grpc.StatusCode.UNAVAILABLE, _DRAINING)


_DRAINING = "the server is shutting down; retry on another replica"


def refusing(handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses with `code` (and counts the refusal)."""
    rpc = method.rsplit("/", 1)[-1]

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        metrics.REQUESTS.labels("grpc", rpc, "", code.name).inc()
        if code is grpc.StatusCode.UNAVAILABLE:  # retryable: when, as HTTP's Retry-After says it
            context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
        await context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    # No request deserializer: the body of a refused call is never parsed.
    return make(refuse, response_serializer=handler.response_serializer)
