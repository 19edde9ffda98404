"""The front-end role: the faces (gRPC: ours, TEI's, health, reflection; HTTP: OpenAI, Cohere/Jina, TEI) on the
server's ports, over each served model's Engine (engine/engine.py) and its Core.

One per process that answers calls: beside the engine host in a one-process server (its Cores are LocalCores,
called directly), or in each front-end process with `--frontends N` (RemoteCores over the link). Either way it
listens first (health NOT_SERVING), gets its models as they are ready, and follows the engine host's status.

A drain turns health NOT_SERVING, refuses new calls (gRPC: UNAVAILABLE, HTTP: 503), gives calls in flight over
either protocol (SSE streams included) up to the grace period, then stops the faces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from embedserv import tracing
from embedserv.config import ModelConfig, ServerConfig
from embedserv.engine.engine import Engine
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.errors import ConfigError
from embedserv.server.frontend import Frontend, InflightLimiter, ServedModels
from embedserv.server.grpc.services import add_services
from embedserv.server.grpc.status import DrainInterceptor
from embedserv.server.security import ApiKeyInterceptor, server_credentials

if TYPE_CHECKING:
    from embedserv.server.http.app import HttpServer

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_options(config: ServerConfig, receive_limit: int) -> list[tuple[str, int]]:
    options = [
        # A request past this (Frontend.receive_limit) is refused (RESOURCE_EXHAUSTED) before it is parsed.
        # Responses are bounded by the requests they answer; clients set their own receive limit.
        ("grpc.max_receive_message_length", receive_limit),
        ("grpc.max_send_message_length", -1),
        # gRPC shares ports by default: a second server on a busy port would start silently. Front ends
        # share them on purpose.
        ("grpc.so_reuseport", 1 if config.num_frontends > 1 else 0),
    ]
    if config.max_connection_age is not None:
        # gRPC jitters the age by +-10% so that clients do not reconnect in step; with no grace option
        # set, calls in flight on a closing connection run to their end.
        options.append(("grpc.max_connection_age_ms", max(1, round(config.max_connection_age * 1000))))
    return options


class FrontendServer:
    def __init__(self, config: ServerConfig, limiter: InflightLimiter) -> None:
        """`limiter`: this process's count of inputs in flight, or with --frontends N the one every front end
        shares."""
        self.config = config
        self.models = ServedModels(
            [m.served_name for m in config.models], {name: m.served_name for m in config.models for name, _ in m.lora}
        )
        self.frontend = Frontend(self.models, config, limiter)
        self.health = health.aio.HealthServicer()
        interceptors: list[grpc.aio.ServerInterceptor] = [DrainInterceptor(self.frontend)]
        if self.frontend.keys:
            interceptors.append(ApiKeyInterceptor(self.frontend.keys))
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(config, self.frontend.receive_limit),
        )
        add_services(self.frontend, self.server, self.health)
        self.port: int | None = None
        self.http: HttpServer | None = None
        # Every model loaded and started (the engine host says when).
        self.started = False
        self._health_updates: set[asyncio.Task] = set()
        self._stopping: asyncio.Task | None = None

    def add_model(self, config: ModelConfig, served: ServedModel, core: Core) -> None:
        """A model ready to serve: its Engine (task services) over `core`."""
        self.models.add(Engine(config, served, core))

    def status_changed(self, started: bool) -> None:
        """The engine host's status changed (a model's serving, or every model started): health follows."""
        self.started = started
        task = asyncio.create_task(self.update_health())
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def update_health(self) -> None:
        """A model is SERVING while one of its workers is; the server ("") once started and all models are."""
        engines = self.models.engines
        serving = {engine.info.name: engine.core.status().serving for engine in engines}
        for engine in engines:
            # A --lora adapter serves when its base does (same core).
            for name in (engine.info.name, *engine.info.lora_adapters):
                await self.health.set(name, _SERVING if serving[engine.info.name] else _NOT_SERVING)
        everyone = self.started and len(engines) == len(self.models.names) and all(serving.values())
        await self.health.set("", _SERVING if everyone else _NOT_SERVING)

    async def listen(self) -> None:
        """gRPC (health NOT_SERVING) and HTTP on the configured ports; ConfigError when a port is taken."""
        for name in ("", *self.models.names, *self.models.lora_bases):
            await self.health.set(name, _NOT_SERVING)
        config = self.config
        # Here, in every process that answers calls (each front end builds its own provider, after spawn).
        if tracing.setup(config.otlp_endpoint):
            logger.info("tracing: sending spans to %s (OTLP/gRPC)", config.otlp_endpoint)
        address = f"{config.host}:{config.port}"
        try:
            if config.tls_cert:
                credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {address} ({exc}); is the port in use? pick another --port") from exc
        if self.frontend.keys and not config.tls_cert:
            logger.warning("an API key without TLS travels in clear text; use --tls-cert/--tls-key off localhost")
        if config.http_port:
            from embedserv.server.http.app import HttpServer  # FastAPI and uvicorn load only when HTTP is on

            self.http = HttpServer(self.frontend)
            await self.http.start()
        await self.server.start()
        security = []
        if config.tls_cert:
            security.append("mutual TLS" if config.tls_client_ca else "TLS")
        if self.frontend.keys:
            count = len(self.frontend.keys.keys)
            security.append("API key" if count == 1 else f"{count} API keys")
        logger.info(
            "listening on %s:%d%s (NOT_SERVING until the models are warm)",
            config.host,
            self.port,
            f" with {' and '.join(security)}" if security else "",
        )

    async def drain(self, grace: float | None) -> None:
        """NOT_SERVING, refuse new calls, give those in flight `grace` seconds, then stop the faces.

        Health answers (NOT_SERVING) to the end, and its Watch streams see the change, but the drain does not
        wait for them (they never end on their own): once the inference calls are done, what is left is
        cancelled."""
        await self.health.enter_graceful_shutdown()
        self.frontend.draining = True  # new calls refused: gRPC by DrainInterceptor, HTTP by the edge
        if grace:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.frontend.active_calls.wait_idle(), grace)
        await self.cancel_calls()
        if self.http is not None:
            await self.http.stop()

    async def cancel_calls(self) -> None:
        """Stops gRPC, cancelling every call still running: the drain's end, or a second signal while draining.
        Both share one stop: a stop racing another can crash grpcio's aio server (SIGSEGV, grpcio 1.85)."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self.server.stop(None))
        await asyncio.shield(self._stopping)
