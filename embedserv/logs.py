"""Log set-up for the server and its workers: text or JSON lines, and the request id of the current call.

The servicer sets `REQUEST_ID` for each call; the engine copies it onto the call's sequences, so a
batch's log line can say which calls it carried.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_format = "text"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id when in a call, exception."""

    def __init__(self, extra: dict | None = None) -> None:
        super().__init__()
        self.extra = extra or {}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.extra,
        }
        request_id = REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, log_format: str = "text", text_format: str = TEXT_FORMAT, extra: dict | None = None) -> None:
    """Root logging to stderr; `extra` fields go into every JSON line (a worker's name and pid)."""
    global _format
    _format = log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(extra) if log_format == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # gRPC's own debug lines (one per cancelled call, per event loop lookup) would drown ours.
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))


def current_format() -> str:
    """What configure() was given, for the worker processes to log alike."""
    return _format
