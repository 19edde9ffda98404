"""A front-end process of `--frontends N` (front ends 1..N-1; front end 0 is the engine process itself).

It serves gRPC and HTTP on the server's ports beside the others (SO_REUSEPORT), with the same services,
checks and admission as a one-process server: each model is an Engine whose core is a RemoteCore
(remote_core.py), so calls are parsed, checked and tokenized here and run by the engine process. Health
follows the engine's Status messages. Signals are the engine process's to handle: it sends Drain (this
process drains its calls as a one-process server does and says Drained) and CancelAll (a second signal).
The process dies with its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from embedserv import logs
from embedserv.config import ServerConfig
from embedserv.errors import ConfigError
from embedserv.start_up import freeze_start_up_objects

logger = logging.getLogger("embedserv.server.frontend_process")
# How long the last message to the engine process (Drained, or why this front end cannot listen) may take.
_LAST_WORDS_MS = 5000


def run_frontend(
    config: ServerConfig, index: int, address: str, shared_in_flight, log_settings: tuple[str, str], server_class
) -> None:
    """The process's target (multiprocessing, spawn). `server_class` is app.EmbedServer, handed over by the engine
    process (pickled by name) so that this module need not import the server that starts it."""
    from embedserv.executor.worker_main import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(os.getppid())
    level, log_format = log_settings
    logs.configure(
        level, log_format, text_format=f"%(asctime)s %(levelname)s %(name)s [front end {index} pid {os.getpid()}]: "
        "%(message)s", extra={"frontend": index, "pid": os.getpid()},
    )  # fmt: skip
    asyncio.run(_serve(config, index, address, shared_in_flight, server_class))


async def _serve(config: ServerConfig, index: int, address: str, shared_in_flight, server_class) -> None:
    from embedserv.engine.engine import Engine
    from embedserv.engine.served_model import read_served_model
    from embedserv.server import link_messages as m
    from embedserv.server.remote_core import FrontendLink, RemoteCore

    server = server_class(config, shared_in_flight=shared_in_flight, frontend_index=index)
    drain = asyncio.Event()
    drain_grace: list[float] = []
    cores: dict[str, RemoteCore] = {}

    def on_message(message: object) -> None:
        if isinstance(message, m.Status):
            for status in message.models:
                if status.name in cores:
                    cores[status.name].update(status)
            server.set_started(message.started)
        elif isinstance(message, m.Drain):
            drain_grace.append(message.grace)
            drain.set()
        elif isinstance(message, m.CancelAll):
            asyncio.create_task(server.cancel_calls())

    link = FrontendLink(address, index, on_message)
    loop = asyncio.get_running_loop()
    for model in config.models:
        served = await loop.run_in_executor(None, read_served_model, model)
        core = RemoteCore(model.served_name, link, served.tokenizer, config.tokenizer_threads)
        cores[model.served_name] = core
        server.models.add(Engine(model, served, core=core))
        core.add_serving_listener(server.on_serving_change)
    try:
        await server.listen()
    except ConfigError as exc:
        await link.start(m.Hello(index, os.getpid(), str(exc)))
        link.close(linger_ms=_LAST_WORDS_MS)
        return
    await link.start(m.Hello(index, os.getpid()))
    freeze_start_up_objects()
    logger.info("front end %d listening", index)
    await drain.wait()
    await server.stop(drain_grace[0])
    await link.send(m.Drained(index))
    link.close(linger_ms=_LAST_WORDS_MS)
