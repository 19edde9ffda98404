"""What the HTTP routes share: the Frontend, the request's Call, model choice, and the body model base."""

from __future__ import annotations

from typing import TypeVar

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from embedserv.call_class import MAX_PRIORITY, set_priority
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.calls import Call
from embedserv.server.frontend import MODEL_HEADER, Frontend
from embedserv.types import Task

BodyT = TypeVar("BodyT", bound=BaseModel)


class Body(BaseModel):
    """Request bodies: unknown fields are ignored (clients send vendor extras), known ones are checked."""

    model_config = ConfigDict(extra="ignore")


class RequestBody(Body):
    """A route's whole body: Body, and the call's priority (call_class.py)."""

    priority: int | None = Field(
        None,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher runs sooner; absent: the x-priority header, else the server's default.",
    )

    @model_validator(mode="after")
    def _apply_priority(self) -> RequestBody:
        # Validated in the request's own task, before the route runs: the call's class for what it awaits.
        set_priority(self.priority)
        return self


def frontend_of(request: Request) -> Frontend:
    return request.app.state.frontend


def call_of(request: Request) -> Call:
    """The Call the edge made for this request (its id, metrics and log line)."""
    return request.state.call


def _record(request: Request, engine: Engine) -> Engine:
    """Labels the request's Call (metrics, log line) with its route and model once both are known."""
    call = call_of(request)
    call.rpc = getattr(request.scope.get("route"), "path", call.rpc)
    call.model = engine.info.name
    return engine


def engine_named(request: Request, name: str | None) -> Engine:
    """The model a body names (empty: the first served model), recorded on the request's Call."""
    return _record(request, frontend_of(request).models.get(name or ""))


def engine_for_task(request: Request, task: Task, name: str | None = None) -> Engine:
    """The model named by the body or the x-embedserv-model header, else the first serving `task` (TEI's
    routes name no model)."""
    return _record(request, frontend_of(request).engine_for(task, name or request.headers.get(MODEL_HEADER)))


def refuse_unsupported(body: Body, defaults: dict[str, object]) -> None:
    """OpenAI fields this server does not implement: refused when set to anything but their default, so a
    client never gets an answer computed differently from what it asked for."""
    for name, default in defaults.items():
        value = getattr(body, name, default)
        if value is not None and value != default:
            raise InvalidInput(f"{name} is not supported by this server; leave it unset (or {default!r})")


async def json_object(request: Request, expected: str) -> dict:
    """The body as a JSON object, for routes whose body model follows from the body or the model; otherwise
    InvalidInput (400 in OpenAI's style, 422 in TEI's) naming `expected`, what the route takes."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"the body must be a JSON object: {expected}")
    return body


def parsed(model: type[BodyT], body: dict) -> BodyT:
    """`body` validated as `model`; a bad one is the route's 400 or 422, as FastAPI's own validation is."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
