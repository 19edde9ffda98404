"""HTTP error answers in the shape each API family's clients parse, with the status they expect.

OpenAI-style routes (/v1/..., Cohere v1 / Jina rerank) answer `{"error": {"message", "type", "param", "code"}}`;
TEI routes answer `{"error": "...", "error_type": "..."}` with TEI's statuses; Cohere's v2 routes answer
`{"message": "..."}` with OpenAI's statuses. Which one a request gets is its route's (TEI_PATHS, COHERE_PATHS, or
`request.state.error_style` set by a route that decides from the body).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from embedserv.errors import RETRY_AFTER_S, EmbedservError, InvalidInput, ModelNotFound, NotReady, Overloaded

OPENAI, TEI, COHERE = "openai", "tei", "cohere"
# Routes that answer in TEI's shape (/rerank answers in the shape of the body it was sent).
TEI_PATHS = frozenset(
    {
        "/embed",
        "/embed_all",
        "/embed_sparse",
        "/similarity",
        "/predict",
        "/tokenize",
        "/decode",
        "/info",
        "/health",
        "/ping",
        "/",
        "/invocations",
    }
)

COHERE_PATHS = frozenset({"/v2/embed", "/v2/rerank"})


class JSON(JSONResponse):
    """A JSON response serialized by orjson (numpy arrays included). A JSONResponse, so that FastAPI
    documents each route's declared response model rather than a string."""

    def render(self, content: object) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass
class HttpError(Exception):
    """An error the HTTP face decides itself (auth, body size, drain, unknown route)."""

    status: int
    message: str
    param: str | None = None


class BodyTooLarge(StarletteHTTPException):
    """A body without a Content-Length that grows past the limit while read. An HTTPException, because
    FastAPI turns any other error raised while it reads the body into a 400."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


# status -> (OpenAI error type, TEI error_type)
_KINDS = {
    # TEI answers 400 only for an empty batch, typed "empty"; validation errors are its 422.
    400: ("invalid_request_error", "empty"),
    401: ("authentication_error", "validation"),
    404: ("invalid_request_error", "validation"),
    405: ("invalid_request_error", "validation"),
    413: ("invalid_request_error", "validation"),
    415: ("invalid_request_error", "validation"),
    422: ("invalid_request_error", "validation"),
    429: ("rate_limit_error", "overloaded"),
    500: ("server_error", "backend"),
    503: ("server_error", "unhealthy"),
}
# Our errors -> HTTP status, for OpenAI-style routes and for TEI routes (TEI validates with 422).
_STATUS = {
    InvalidInput: (400, 422),
    ModelNotFound: (404, 404),
    Overloaded: (429, 429),
    NotReady: (503, 503),
}
_OPENAI_CODES = {429: "rate_limit_exceeded", 401: "invalid_api_key", 503: "unavailable"}


def error_style(request: Request) -> str:
    style = getattr(request.state, "error_style", None)
    if style is not None:
        return style
    path = request.url.path
    return TEI if path in TEI_PATHS else COHERE if path in COHERE_PATHS else OPENAI


def status_of(exc: BaseException, style: str) -> int:
    if isinstance(exc, HttpError):
        return exc.status
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            openai_status, tei_status = _STATUS[cls]
            return tei_status if style == TEI else openai_status
    return 500


def message_of(exc: BaseException) -> str:
    if isinstance(exc, HttpError):
        return exc.message
    if isinstance(exc, EmbedservError):
        return str(exc)
    return f"the server failed on this request: {exc}"


def error_body(style: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    openai_type, tei_type = _KINDS.get(status, ("invalid_request_error" if status < 500 else "server_error", "backend"))
    if style == TEI:
        return {"error": message, "error_type": tei_type}
    if style == COHERE:
        return {"message": message}
    return {
        "error": {"message": message, "type": openai_type, "param": param, "code": code or _OPENAI_CODES.get(status)}
    }


def error_response(style: str, status: int, message: str, param: str | None = None, code: str | None = None) -> JSON:
    # Both are worth retrying: 429 after a pause, 503 (draining, not ready, a worker lost) on another replica too.
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSON(error_body(style, status, message, param, code), status_code=status, headers=headers)


def exception_response(request: Request, exc: BaseException) -> JSON:
    style = error_style(request)
    code = "model_not_found" if isinstance(exc, ModelNotFound) else None
    return error_response(style, status_of(exc, style), message_of(exc), getattr(exc, "param", None), code)


# Fields of several accepted shapes: one sentence instead of pydantic's error per alternative.
_SHAPES = {
    "input": "input must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "inputs": "inputs must be a string, a list of strings, a list of token ids or a list of lists of token ids",
}
_JSON_TYPES = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "an object",
}


def json_error_message(position: int, document: object) -> str:
    """Where a body fails to parse, as line, column and character offset."""
    text = document if isinstance(document, str) else ""
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return (
        f"the body is not valid JSON (line {line}, column {column}, offset {position}); "
        "send a JSON object with Content-Type: application/json"
    )


def _error_part(error: dict, field: str) -> str:
    if not field and error.get("type") == "missing":
        return "the body is empty; send a JSON object"
    if error.get("type") == "extra_forbidden":
        return f"unrecognized request argument {field!r}; remove it (see /docs for this endpoint's fields)"
    got = _JSON_TYPES.get(type(error.get("input")))
    strict_type = str(error.get("type", "")).endswith("_type") and got is not None
    return f"{field or 'body'}: {error.get('msg', 'invalid')}" + (f", not {got}" if strict_type else "")


def _is_alternative(tag: str) -> bool:
    """Whether a location part is pydantic's tag of a union's member (str, list[...]), not a field name."""
    return "[" in tag or tag in ("str", "int", "float", "bool")


def validation_message(errors: list[dict], body: object = None) -> tuple[str, str | None]:
    """A pydantic/FastAPI validation error list as one sentence, and the first field it names."""
    if errors and errors[0].get("type") == "json_invalid":
        location = errors[0].get("loc", ())
        return json_error_message(location[-1] if isinstance(location[-1], int) else 0, body), None
    parts, param, seen = [], None, set()
    for error in errors:
        location = [str(x) for x in error.get("loc", ()) if x != "body"]
        top = location[0] if location else ""
        # The union's alternative, e.g. input.list[str]; not a field of an object named inputs (/similarity's).
        if top in _SHAPES and len(location) == 2 and _is_alternative(location[1]):
            if top not in seen:
                seen.add(top)
                parts.append(_SHAPES[top])
            param = param or top
            continue
        field = ".".join(location)
        param = param or field or None
        parts.append(_error_part(error, field))
    more = f" (and {len(parts) - 5} more)" if len(parts) > 5 else ""
    return "invalid request: " + "; ".join(parts[:5]) + more, param
