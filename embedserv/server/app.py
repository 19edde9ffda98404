"""Builds and runs the gRPC server: listen first (health NOT_SERVING), load and warm models, then SERVING.

With --http-port, the HTTP APIs (http/app.py) listen beside gRPC from the start, on the same Frontend.

With --frontends N above 1 this process is the engine process: it serves no call itself but keeps the ports
(bound, not listening), serves /metrics, and engine_host.py starts N front-end processes (frontend_process.py,
each an EmbedServer whose engines are remote) that listen on those ports and send it their calls; a drain
drains them first.

SIGTERM or SIGINT drains: health turns NOT_SERVING, new calls are refused (HTTP: 503), calls in flight over
either protocol (SSE streams included) get up to --drain-timeout to finish, then the workers stop and the
process exits 0. A second signal cancels what is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from embedserv import tracing
from embedserv.config import ServerConfig
from embedserv.engine.engine import Engine
from embedserv.errors import ConfigError
from embedserv.server.engine_host import EngineHost
from embedserv.server.metrics_endpoint import MetricsServer
from embedserv.server.frontend import Frontend
from embedserv.server.served_models import InflightLimiter, ServedModels
from embedserv.start_up import freeze_start_up_objects
from embedserv.server.grpc.services import add_services
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


class EmbedServer:
    def __init__(
        self, config: ServerConfig, worker_processes: bool = True, shared_in_flight=None,
        frontend_index: int | None = None,
    ) -> None:
        """`worker_processes` False runs each model in this process (Engine.load, one replica): the tests'
        in-process servers, which then pay no worker process start. A front-end process (frontend_process.py,
        `frontend_index` set) loads no model and shares the engine process's count of inputs in flight."""
        self.config = config
        self.worker_processes = worker_processes
        self.frontend_index = frontend_index
        self.models = ServedModels(
            [m.served_name for m in config.models], {name: m.served_name for m in config.models for name, _ in m.lora}
        )
        if config.num_frontends > 1 and shared_in_flight is None:
            shared_in_flight = multiprocessing.get_context("spawn").Value("q", 0)
        self.limiter = InflightLimiter(config.max_concurrent_requests, shared_in_flight)
        self.host: EngineHost | None = None
        self.health = health.aio.HealthServicer()
        self.frontend = Frontend(self.models, config, self.limiter)
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(config.api_key)] if config.api_key else None,
            options=server_options(config, self.frontend.receive_limit),
        )
        self.servicer = add_services(self.frontend, self.server, self.health)
        self.port: int | None = None
        self.metrics: MetricsServer | None = None
        self.http: HttpServer | None = None
        self._started = False
        # The engines whose workers are starting, so that a stop during start-up ends them too.
        self._loading: list[Engine] = []
        self._health_updates: set[asyncio.Task] = set()

    async def _set_health(self, status) -> None:
        for name in ("", *self.models.names, *self.models.adapters):
            await self.health.set(name, status)

    def set_started(self, started: bool) -> None:
        """A front end's Status from the engine process: every model loaded and started."""
        if started != self._started:
            self._started = started
            self.on_serving_change(started)

    def on_serving_change(self, serving: bool) -> None:
        task = asyncio.create_task(self._update_health())
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _update_health(self) -> None:
        """A model is SERVING while one of its workers is; the server ("") once started and all models are."""
        engines = self.models.engines
        for engine in engines:
            # A --lora adapter serves when its base does (same engine).
            for name in (engine.info.name, *engine.info.lora_adapters):
                await self.health.set(name, _SERVING if engine.is_serving else _NOT_SERVING)
        everyone = self._started and all(engine.is_serving for engine in engines)
        await self.health.set("", _SERVING if everyone else _NOT_SERVING)
        if self.host is not None:
            self.host.started = self._started
            await self.host.broadcast(self.host.status())

    async def start(self) -> None:
        if self.config.num_frontends > 1:
            self.host = EngineHost(self.config, self.models, self.limiter.shared, type(self))
            self.port = self.host.port
            self._start_metrics()
        else:
            await self.listen()
        # Models load at once, each in its own worker processes, while the front ends start; the first failure
        # cancels the others.
        loads = [asyncio.create_task(self._start_model(m)) for m in self.config.models]
        if self.host is not None:
            loads.append(asyncio.create_task(self.host.start()))
        try:
            await asyncio.gather(*loads)
        except BaseException:
            for load in loads:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
            raise
        self._started = True
        await self._update_health()
        logger.info("serving %s", ", ".join(self.models.names))

    def _start_metrics(self) -> None:
        if self.config.metrics_port is not None:
            frontends_dir = self.host.metrics_dir if self.host is not None else None
            self.metrics = MetricsServer(
                self.config.host, self.config.metrics_port, self.models, self.limiter, frontends_dir
            )

    async def listen(self) -> None:
        """gRPC (health NOT_SERVING), HTTP and, unless this is a front-end process, the metrics port."""
        await self._set_health(_NOT_SERVING)
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
        if config.api_key and not config.tls_cert:
            logger.warning("an API key without TLS travels in clear text; use --tls-cert/--tls-key off localhost")
        if self.frontend_index is None:
            self._start_metrics()
        if config.http_port:
            from embedserv.server.http.app import HttpServer  # FastAPI and uvicorn load only when HTTP is on

            self.http = HttpServer(self.frontend)
            await self.http.start()
        await self.server.start()
        security = []
        if config.tls_cert:
            security.append("mutual TLS" if config.tls_client_ca else "TLS")
        if config.api_key:
            security.append("API key")
        logger.info(
            "listening on %s:%d%s (NOT_SERVING until the models are warm)", config.host, self.port,
            f" with {' and '.join(security)}" if security else "",
        )

    async def _start_model(self, model_config) -> None:
        engine = await asyncio.get_running_loop().run_in_executor(None, self._load_engine, model_config)
        # Until it serves, stop() finds it here (a signal or another model's failure during start-up).
        self._loading.append(engine)
        await engine.start()
        self._loading.remove(engine)
        self.models.add(engine)
        engine.add_serving_listener(self.on_serving_change)
        await self._update_health()

    def _load_engine(self, model_config) -> Engine:
        if self.worker_processes:
            return Engine.with_worker_processes(model_config, self.config.tokenizer_threads)
        return Engine.load(model_config, self.config.tokenizer_threads, warm_up=model_config.warm_up)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, refuse new calls, give those in flight `grace` seconds, then stop the engines.

        Health Watch streams see NOT_SERVING, but the drain does not wait for them (they never end on
        their own): once the inference calls are done, what is left is cancelled."""
        if self.host is not None:
            await self.host.drain(grace)
        else:
            await self._drain(grace)
        for engine in [*self.models.engines, *self._loading]:
            await engine.stop()
        if self.host is not None:
            await self.host.stop()
        if self.metrics is not None:
            self.metrics.stop()
        tracing.shutdown()

    async def _drain(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        self.frontend.draining = True
        stopping = asyncio.create_task(self.server.stop(grace))
        if grace:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.frontend.active_calls.wait_idle(), grace)
        await self.server.stop(None)
        await stopping
        if self.http is not None:
            await self.http.stop()

    async def cancel_calls(self) -> None:
        """Cancels every call still running (a second signal while draining)."""
        if self.host is not None:
            await self.host.cancel_calls()
        await self.server.stop(None)


async def run(config: ServerConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains (a second signal cuts the drain short)."""
    server = EmbedServer(config)
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        starting = asyncio.create_task(server.start())
        first_signal = asyncio.create_task(signals.get())
        await asyncio.wait((starting, first_signal), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # No call can be in flight yet: stop loading and exit rather than finish a long load first.
            logger.info("%s while loading: stopping", signal.Signals(first_signal.result()).name)
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        else:
            starting.result()  # a start-up error ends here (exit 2)
            freeze_start_up_objects()
            logger.info(
                "%s: draining; refusing new calls, up to %.0f s for those in flight (signal again to cancel them)",
                signal.Signals(await first_signal).name, config.drain_timeout,
            )
    finally:
        first_signal.cancel()
        drain = asyncio.create_task(server.stop(config.drain_timeout))
        second = asyncio.create_task(signals.get())
        await asyncio.wait((drain, second), return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            logger.warning("second signal: cancelling the calls still running")
            await server.cancel_calls()
        second.cancel()
        await drain
    logger.info("stopped")
