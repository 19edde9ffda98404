"""Maps engine errors to gRPC status codes; nothing a request does may take the server down."""

from __future__ import annotations

import grpc

from embedserv.errors import AdapterNotFound, EmbedservError, InvalidInput, ModelNotFound, NotReady, Overloaded

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
