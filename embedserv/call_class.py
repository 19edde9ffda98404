"""A call's scheduling class: its priority and its tenant (the name of the API key it came with).

The front end sets CALL_CLASS where a call arrives (the gRPC and HTTP edges, from the request's `priority`
field, the `x-priority` header or metadata, and the API key's defaults); it crosses to the engine host with the
call, and the engine stamps it on the call's sequences (scheduler/waiting.py orders them). No torch.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from embedserv.errors import InvalidInput
from embedserv.scheduler.request import Request

PRIORITY_HEADER = "x-priority"
# Priorities are small integers: a bound keeps a typo (a timestamp, a port) from meaning anything.
MAX_PRIORITY = 1_000_000


@dataclass(frozen=True)
class CallClass:
    # Higher runs sooner; None: the served model's default (--default-priority).
    priority: int | None = None
    tenant: str = ""


_UNCLASSED = CallClass()
CALL_CLASS: contextvars.ContextVar[CallClass] = contextvars.ContextVar("call_class", default=_UNCLASSED)


def checked_priority(value: object, where: str) -> int:
    """`value` (an int, or a header's text) as a priority; InvalidInput naming `where` otherwise."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InvalidInput(f"{where} must be an integer priority (higher runs sooner), not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
        raise InvalidInput(f"{where} must be an integer from -{MAX_PRIORITY} to {MAX_PRIORITY}, not {value!r}")
    return value


def set_priority(priority: int | None) -> None:
    """The current call's priority (None leaves what is set: a header's, or the API key's default)."""
    if priority is not None:
        current = CALL_CLASS.get()
        CALL_CLASS.set(CallClass(priority, current.tenant))


def stamp(request: Request, default_priority: int) -> Request:
    """`request` with the current call's priority (else `default_priority`) and tenant."""
    current = CALL_CLASS.get()
    request.priority = default_priority if current.priority is None else current.priority
    request.tenant = current.tenant
    return request
