"""Errors a request can end with. The server maps each to its gRPC status code."""


class EmbedservError(Exception):
    """Base class: the message is shown to the client as is, so it says what to change."""


class InvalidInput(EmbedservError):
    """The request itself is wrong (INVALID_ARGUMENT)."""


class ModelNotFound(EmbedservError):
    """The request names a model this server does not serve (NOT_FOUND)."""


class AdapterNotFound(ModelNotFound):
    """`<model>:<adapter>` names an adapter the served model lacks (INVALID_ARGUMENT; HTTP 404 as ModelNotFound)."""


class Overloaded(EmbedservError):
    """Too much work in flight; retry later (RESOURCE_EXHAUSTED)."""


# Seconds a refused (overloaded) caller should wait, sent as HTTP's Retry-After and gRPC's `retry-after` trailing
# metadata: admission frees up as calls in flight end, well within a second.
RETRY_AFTER_S = 1


class NotReady(EmbedservError):
    """The model is loading, or the engine has stopped (UNAVAILABLE)."""


class ConfigError(EmbedservError):
    """Start-up configuration that cannot work; the server refuses to start."""
