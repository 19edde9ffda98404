"""Which engines answer which model names, and how much work the server admits at once."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

from embedserv.engine.engine import Engine
from embedserv.errors import ModelNotFound, NotReady, Overloaded


class ServedModels:
    """Model names in --model order; an empty name in a request means the first."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._engines: dict[str, Engine] = {}

    def add(self, engine: Engine) -> None:
        self._engines[engine.info.name] = engine

    @property
    def engines(self) -> list[Engine]:
        return [self._engines[n] for n in self.names if n in self._engines]

    def get(self, name: str) -> Engine:
        name = name or self.names[0]
        if name not in self.names:
            raise ModelNotFound(f"model {name!r} is not served here; served models: {', '.join(self.names)}")
        engine = self._engines.get(name)
        if engine is None or not engine.is_running:
            raise NotReady(f"model {name!r} is still loading; retry when health reports SERVING")
        return engine


class _LocalCount:
    """A count only this process changes: the shape of multiprocessing.Value, without its lock."""

    value = 0

    def get_lock(self):
        return nullcontext()


class InflightLimiter:
    """Counts inputs (not calls) in flight; refuses at once past the limit rather than queue without bound.

    With several front-end processes the count is `shared` (a multiprocessing.Value("q") every front end
    holds), changed under its lock, so the limit holds for the whole server."""

    def __init__(self, limit: int, shared=None) -> None:
        self.limit = limit
        self.shared = shared
        self._count = shared if shared is not None else _LocalCount()

    @property
    def in_flight(self) -> int:
        return self._count.value

    @contextmanager
    def hold(self, count: int) -> Iterator[None]:
        with self._count.get_lock():
            in_flight = self._count.value
            if in_flight + count <= self.limit:
                self._count.value = in_flight + count
        if in_flight + count > self.limit:
            raise Overloaded(
                f"server is at its limit of {self.limit} inputs in flight ({in_flight} now); "
                "retry with backoff or send fewer inputs per call"
            )
        try:
            yield
        finally:
            with self._count.get_lock():
                self._count.value -= count
