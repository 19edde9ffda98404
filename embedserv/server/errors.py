"""Maps engine errors to gRPC status codes; nothing a request does may take the server down."""

from __future__ import annotations

import functools
import logging

import grpc

from embedserv.errors import EmbedservError, InvalidInput, ModelNotFound, NotReady, Overloaded

logger = logging.getLogger(__name__)

_CODES: dict[type[EmbedservError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: EmbedservError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, EmbedservError):
        await context.abort(status_for(exc), str(exc))
    logger.exception("%s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the server: {exc}")


def unary_errors(handler):
    """Turns exceptions of a unary handler into status codes (aborts pass through)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            await _abort(context, handler.__name__, exc)

    return wrapper


def stream_errors(handler):
    """The same for handlers that yield responses."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            async for response in handler(self, request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, handler.__name__, exc)

    return wrapper
