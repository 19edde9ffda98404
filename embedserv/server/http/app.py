"""The HTTP server: the OpenAI-compatible, Cohere/Jina rerank and TEI routes on --http-port, in the gRPC
server's process and event loop, on the same engines and Frontend.

FastAPI builds the routes and their OpenAPI document (/openapi.json, and /docs with Swagger UI served from
the swagger-ui-bundle package: no CDN); uvicorn serves it on a socket we bind ourselves, so a port in use
is a start-up error with a message, and uvicorn never installs signal handlers of its own (the server's
drain owns SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.staticfiles import StaticFiles

import embedserv
from embedserv.errors import ConfigError, EmbedservError
from embedserv.server.frontend import Frontend, bound_socket
from embedserv.server.http import cohere, metrics_route, openai, scoring, tei, token_classify
from embedserv.server.http.edge import Edge
from embedserv.server.http.error_responses import (
    JSON,
    HttpError,
    error_response,
    error_style,
    exception_response,
    validation_message,
)

logger = logging.getLogger(__name__)


def _swagger_dir() -> Path:
    import swagger_ui_bundle

    return Path(swagger_ui_bundle.swagger_ui_path)


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(
        title="embedserv",
        version=getattr(embedserv, "__version__", "0"),
        description="OpenAI-compatible, Cohere/Jina-style and TEI-compatible HTTP APIs of embedserv.",
        docs_url=None,
        redoc_url=None,
        default_response_class=JSON,
    )
    app.state.frontend = frontend
    for module in (openai, scoring, token_classify, cohere, tei, metrics_route):
        app.include_router(module.router)
    app.mount("/docs/assets", StaticFiles(directory=_swagger_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="embedserv API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )

    @app.exception_handler(EmbedservError)
    @app.exception_handler(HttpError)
    async def known_error(request: Request, exc: Exception):
        return exception_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        style = error_style(request)
        errors = list(exc.errors())
        on_body = any(error.get("loc", ("",))[0] == "body" for error in errors)
        if on_body and not _is_json(request.headers.get("content-type", "")):
            # FastAPI reads any other body as bytes and says only that it is no object.
            got = request.headers.get("content-type") or "no Content-Type"
            return error_response(style, 415, f"send the body as JSON with Content-Type: application/json (got {got})")
        message, param = validation_message(errors, exc.body)
        return error_response(style, 422 if style == "tei" else 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; see /docs for this server's routes"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs"
        response = error_response(error_style(request), exc.status_code, message)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The edge logs it with the request id once this answer is sent.
        return exception_response(request, exc)

    return app


def _is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _tls_context(config) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        context.load_verify_locations(config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The embedserv server owns SIGTERM/SIGINT and tells us when to stop (HttpServer.stop).
        yield


class HttpServer:
    """uvicorn serving build_app(frontend) on host:port, started and stopped by the gRPC server's run()."""

    def __init__(self, frontend: Frontend) -> None:
        config = frontend.config
        self.frontend = frontend
        self.host, self.port = config.host, config.http_port
        self.scheme = "https" if config.tls_cert else "http"
        self._socket = self._bind(config)
        uv_config = uvicorn.Config(
            Edge(build_app(frontend), frontend),
            log_config=None,
            access_log=False,
            lifespan="off",
            server_header=False,
            # Calls in flight are drained before stop() (app.py); what is left after this is cut.
            timeout_graceful_shutdown=5,
        )
        context = _tls_context(config)
        if context is not None:
            uv_config.load()
            uv_config.ssl = context
        self._server = _Uvicorn(uv_config)
        self._task: asyncio.Task | None = None

    def _bind(self, config) -> socket.socket:
        try:
            sock = bound_socket(self.host, self.port, reuse_port=config.num_frontends > 1)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve HTTP on {self.host}:{self.port} ({exc.strerror}); pick another --http-port "
                "(0 turns HTTP off)"
            ) from None
        # Accepted connections inherit it: a response's head and body are two writes, and with Nagle the
        # second waits for the client's delayed ACK (40 ms a call, measured).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise ConfigError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        logger.info("HTTP APIs at %s://%s:%d (docs at /docs)", self.scheme, self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._socket.close()
