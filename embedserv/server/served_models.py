"""Which engines answer which model names, and how much work the server admits at once."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

from embedserv.engine.engine import Engine
from embedserv.errors import AdapterNotFound, ModelNotFound, NotReady, Overloaded


class ServedModels:
    """Model names in --model order; an empty name in a request means the first. A --lora adapter answers to
    its own name and to `<base>:<name>`, on its base's engine (Engine.adapter_engine)."""

    def __init__(self, names: list[str], adapters: dict[str, str] | None = None) -> None:
        self.names = list(names)
        # Adapter name -> its base model's name, from the config (known before the engines load).
        self.adapters = dict(adapters or {})
        self._engines: dict[str, Engine] = {}
        self._adapter_engines: dict[str, Engine] = {}

    def add(self, engine: Engine) -> None:
        self._engines[engine.info.name] = engine
        for name in engine.info.lora_adapters:
            self.adapters[name] = engine.info.name
            self._adapter_engines[name] = engine.adapter_engine(name)

    @property
    def engines(self) -> list[Engine]:
        return [self._engines[n] for n in self.names if n in self._engines]

    def adapter_engines(self, base: Engine) -> list[Engine]:
        """The base model's adapters as served models, in their --lora order."""
        return [self._adapter_engines[n] for n in base.info.lora_adapters if n in self._adapter_engines]

    def served(self) -> str:
        """What an unknown name's message lists: every model, with its adapters."""
        adapters = {base: [a for a, b in self.adapters.items() if b == base] for base in self.names}
        return ", ".join(f"{n} (adapters: {', '.join(adapters[n])})" if adapters[n] else n for n in self.names)

    def get(self, name: str) -> Engine:
        name = name or self.names[0]
        base, colon, adapter = name.partition(":")
        if colon and base in self.names:
            if self.adapters.get(adapter) != base:
                raise AdapterNotFound(
                    f"model {base!r} has no LoRA adapter {adapter!r}; served models: {self.served()}"
                )
            name = adapter
        elif name not in self.names and name not in self.adapters:
            raise ModelNotFound(f"model {name!r} is not served here; served models: {self.served()}")
        engine = self._engines.get(self.adapters.get(name, name))
        if engine is None or not engine.is_running:
            raise NotReady(f"model {name!r} is still loading; retry when health reports SERVING")
        return self._adapter_engines[name] if name in self.adapters else engine


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
