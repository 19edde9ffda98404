"""GET /metrics on the HTTP port: the --metrics-port page, relayed.

The Gateway API Inference Extension's endpoint picker scrapes /metrics on its InferencePool's target port,
which is our HTTP port; vLLM serves its metrics there too. The page itself is built where the engines are
(server/metrics_endpoint.py: the first process), while an HTTP call may land on any --frontends process, so
every process relays it from the metrics port over loopback instead of building its own.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from embedserv.errors import NotReady
from embedserv.server.http.common import frontend_of
from embedserv.server.http.error_responses import HttpError

router = APIRouter()

_TIMEOUT_S = 10.0
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


async def _fetch(host: str, port: int) -> tuple[bytes, bytes]:
    """(content type, body) of http://host:port/metrics (HTTP/1.0: the server closes after the body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        reply = await reader.read()
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *headers = head.split(b"\r\n")
    if b" 200 " not in status + b" ":
        raise NotReady(f"the metrics port answered {status.decode('latin-1')!r}; retry")
    content_type = b"text/plain; version=0.0.4; charset=utf-8"
    for line in headers:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-type":
            content_type = value.strip()
    return content_type, body


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    config = frontend_of(request).config
    if not config.metrics_port:
        raise HttpError(
            404, "metrics are off on this server; start it with --metrics-port PORT (a fixed port) to serve /metrics"
        )
    host = "127.0.0.1" if config.host in _ANY_ADDRESS else config.host
    try:
        content_type, body = await asyncio.wait_for(_fetch(host, config.metrics_port), _TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        raise NotReady(f"the metrics port {config.metrics_port} did not answer ({exc!r}); retry") from None
    return Response(body, media_type=content_type.decode("latin-1"))
