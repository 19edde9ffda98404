"""Builds and runs the gRPC server: listen first (health NOT_SERVING), load and warm models, then SERVING."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedserv.config import ServerConfig
from embedserv.engine.engine import Engine
from embedserv.errors import ConfigError
from embedserv.server.registry import ServedModels
from embedserv.server.servicer import InferenceServicer, add_to_server

logger = logging.getLogger(__name__)

# Generous until admission limits derive them (64 MiB): a full client batch of long texts fits.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EmbedServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.models = ServedModels([m.served_name for m in config.models])
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                # gRPC shares ports by default: a second server on a busy port would start silently.
                ("grpc.so_reuseport", 0),
            ]
        )
        service = add_to_server(InferenceServicer(self.models, config), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port: int | None = None
        self._started = False
        self._stopping = False
        self._health_updates: set[asyncio.Task] = set()

    async def _set_health(self, status) -> None:
        for name in ("", *self.models.names):
            await self.health.set(name, status)

    def _on_serving_change(self, serving: bool) -> None:
        task = asyncio.create_task(self._update_health())
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _update_health(self) -> None:
        """A model is SERVING while one of its workers is; the server ("") once started and all models are."""
        if self._stopping:
            return
        engines = self.models.engines
        for engine in engines:
            await self.health.set(engine.info.name, _SERVING if engine.is_serving else _NOT_SERVING)
        everyone = self._started and all(engine.is_serving for engine in engines)
        await self.health.set("", _SERVING if everyone else _NOT_SERVING)

    async def start(self) -> None:
        await self._set_health(_NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {address} ({exc}); is the port in use? pick another --port") from exc
        await self.server.start()
        logger.info("listening on %s:%d (NOT_SERVING until the models are warm)", self.config.host, self.port)
        loop = asyncio.get_running_loop()
        for model_config in self.config.models:
            engine = await loop.run_in_executor(
                None, Engine.with_worker_processes, model_config, self.config.tokenizer_threads
            )
            await engine.start()
            self.models.add(engine)
            engine.add_serving_listener(self._on_serving_change)
            await self._update_health()
        self._started = True
        await self._update_health()
        logger.info("serving %s", ", ".join(self.models.names))

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        await self._set_health(_NOT_SERVING)
        await self.server.stop(grace)
        for engine in self.models.engines:
            await engine.stop()


async def run(config: ServerConfig) -> None:
    """Serves until SIGTERM or SIGINT."""
    server = EmbedServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        await stop.wait()
        logger.info("stopping")
    finally:
        await server.stop()
