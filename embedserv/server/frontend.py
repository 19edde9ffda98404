"""What every API face shares: the served models, the request limits, admission and the calls in flight.

The gRPC services (ours and TEI's) and the HTTP routes (OpenAI, Cohere, TEI) all check requests and
admit work through one Frontend, so a limit, a message or a drain behaves the same whichever protocol a
client speaks.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

from embedserv.api_keys import KeyTable
from embedserv.call_class import CALL_CLASS
from embedserv.config import ServerConfig
from embedserv.engine.engine import Engine
from embedserv.engine.inputs.image_inputs import input_images, input_texts
from embedserv.errors import AdapterNotFound, InvalidInput, ModelNotFound, NotReady, Overloaded
from embedserv.models.loading.spec_reader import takes_images
from embedserv.types import EmbedInput, InterleavedInput, Modality, Task


def bound_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), not yet listening; OSError when the port is taken.
    `reuse_port`: front-end processes share the port (the kernel spreads new connections over them)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# TEI's API names no model: a client picks one with this header (HTTP) or metadata key (gRPC).
MODEL_HEADER = "x-embedserv-model"


class ServedModels:
    """Model names in --model order; an empty name in a request means the first. A --lora adapter answers to
    its own name and to `<base>:<name>`, on its base's engine (Engine.for_adapter)."""

    def __init__(self, names: list[str], lora_bases: dict[str, str] | None = None) -> None:
        self.names = list(names)
        # --lora adapter name -> its base model's name, from the config (known before the engines load).
        self.lora_bases = dict(lora_bases or {})
        self._engines: dict[str, Engine] = {}
        self._lora_engines: dict[str, Engine] = {}

    def add(self, engine: Engine) -> None:
        self._engines[engine.info.name] = engine
        for name in engine.info.lora_adapters:
            self.lora_bases[name] = engine.info.name
            self._lora_engines[name] = engine.for_adapter(name)

    @property
    def engines(self) -> list[Engine]:
        return [self._engines[n] for n in self.names if n in self._engines]

    def lora_engines(self, base: Engine) -> list[Engine]:
        """The base model's adapters as served models, in their --lora order."""
        return [self._lora_engines[n] for n in base.info.lora_adapters if n in self._lora_engines]

    def served(self) -> str:
        """What an unknown name's message lists: every model, with its adapters."""
        adapters = {base: [a for a, b in self.lora_bases.items() if b == base] for base in self.names}
        return ", ".join(f"{n} (adapters: {', '.join(adapters[n])})" if adapters[n] else n for n in self.names)

    def get(self, name: str) -> Engine:
        name = name or self.names[0]
        base, colon, adapter = name.partition(":")
        if colon and base in self.names:
            if self.lora_bases.get(adapter) != base:
                raise AdapterNotFound(f"model {base!r} has no LoRA adapter {adapter!r}; served models: {self.served()}")
            name = adapter
        elif name not in self.names and name not in self.lora_bases:
            raise ModelNotFound(f"model {name!r} is not served here; served models: {self.served()}")
        engine = self._engines.get(self.lora_bases.get(name, name))
        if engine is None:
            raise NotReady(f"model {name!r} is still loading; retry when health reports SERVING")
        return self._lora_engines[name] if name in self.lora_bases else engine


class InflightLimiter:
    """Counts inputs (not calls) in flight; refuses at once past the limit rather than queue without bound, and
    past a tenant's cap (its API key's share of the limit, api_keys.py) for that tenant's calls.

    With several front-end processes the counts are `shared` (shared_counts.SharedCounts, which every front end
    maps: the total, then one per API key in config order), changed under its lock, so the limits hold for the
    whole server."""

    def __init__(self, limit: int, shared=None, caps: dict[str, int] | None = None) -> None:
        self.limit = limit
        self.shared = shared
        # tenant -> (its slot in the counts, its cap)
        self._tenants = {name: (index + 1, cap) for index, (name, cap) in enumerate((caps or {}).items())}
        self._counts = shared if shared is not None else [0] * (1 + len(self._tenants))
        self._lock = shared.get_lock() if shared is not None else nullcontext()

    @classmethod
    def for_config(cls, config: ServerConfig, shared=None) -> InflightLimiter:
        caps = KeyTable(config.all_api_keys, config.max_concurrent_requests).caps
        return cls(config.max_concurrent_requests, shared, caps)

    @property
    def in_flight(self) -> int:
        return self._counts[0]

    @contextmanager
    def hold(self, count: int) -> Iterator[None]:
        """Admits `count` inputs of the current call's tenant for the duration of a with-block, or raises
        Overloaded at once."""
        slot, cap = self._tenants.get(CALL_CLASS.get().tenant, (0, 0))
        with self._lock:
            in_flight, held = self._counts[0], self._counts[slot]
            fits = in_flight + count <= self.limit and (not slot or held + count <= cap)
            if fits:
                self._counts[0] = in_flight + count
                if slot:
                    self._counts[slot] = held + count
        if not fits:
            raise Overloaded(self._refusal(count, in_flight, held if slot else None, cap))
        try:
            yield
        finally:
            with self._lock:
                self._counts[0] -= count
                if slot:
                    self._counts[slot] -= count

    def _refusal(self, count: int, in_flight: int, held: int | None, cap: int) -> str:
        if in_flight + count > self.limit or held is None:
            return (
                f"server is at its limit of {self.limit} inputs in flight ({in_flight} now); "
                "retry with backoff or send fewer inputs per call"
            )
        return (
            f"this API key's calls are at their share of {cap} inputs in flight ({held} now, of the server's "
            f"{self.limit}); retry with backoff or send fewer inputs per call"
        )


class ActiveCalls:
    """Inference calls still running, over every protocol: what a drain waits for (health checks and
    health Watch streams, which never end on their own, are not among them)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class Frontend:
    def __init__(self, models: ServedModels, config: ServerConfig, limiter: InflightLimiter) -> None:
        self.models = models
        self.config = config
        self.limiter = limiter
        # The server's API keys (none: no authentication), for the gRPC interceptor and the HTTP edge.
        self.keys = KeyTable(config.all_api_keys, config.max_concurrent_requests)
        # The largest request message (gRPC) and body (HTTP): room for images only where a model takes them.
        self.receive_limit = config.receive_limit(any(takes_images(model) for model in config.models))
        self.active_calls = ActiveCalls()
        # Set when a drain starts: HTTP answers new calls 503 (gRPC's own server refuses them).
        self.draining = False

    def engine_for(self, task: Task, name: str | None = None) -> Engine:
        """The named model, else the first served model (in --model order) that serves `task`."""
        if name:
            return self.models.get(name)
        engines = self.models.engines
        for engine in engines:
            if task in engine.info.tasks:
                return engine
        if len(engines) < len(self.models.names):
            raise NotReady("models are still loading; retry when health reports SERVING")
        served = "; ".join(f"{e.info.name}: {', '.join(t.value for t in e.info.tasks)}" for e in engines)
        raise ModelNotFound(
            f"no served model can {task.value}; served models and their tasks: {served}. "
            f"Name one with the {MODEL_HEADER} header or metadata key"
        )

    def check_inputs(self, inputs: Iterable[str], what: str = "inputs") -> list[str]:
        """At least one text, no more than a call may carry, none past --max-input-chars (before tokenizing)."""
        texts = list(inputs)
        if texts:
            self.check_batch(len(texts), what)
        return self.check_texts(texts, what)

    def check_items(self, engine: Engine, items: list[EmbedInput], what: str = "inputs") -> list:
        """Texts and images in one list: at least one, no more than a call may carry (an image counts as an
        input; an interleaved input as one), images only for a model that takes them and within the image limits,
        texts (and an image's text) within the character limit."""
        if not items:
            raise InvalidInput(f"{what} is empty; send at least one text or image")
        self.check_batch(len(items), what)
        self.check_images(engine, items)
        self.check_item_chars(items, what)
        return items

    def check_item_chars(self, items: list[EmbedInput], what: str) -> None:
        """Each input's texts within --max-input-chars: a text, an image's text, an interleaved input's texts
        together (the model reads them as one input)."""
        for index, item in enumerate(items):
            self.check_chars(_text(item), f"{what}[{index}]")

    def check_images(self, engine: Engine, items: list, first_index: int = 0) -> None:
        """The images among `items`: a model that takes images, no more of them than --max-images-per-request,
        each within the model's --max-image-bytes (checked before any of it is decoded). Messages name an image
        as "input N", N its place among the inputs the engine gets (from `first_index`), as the decoder's do, and
        an interleaved input's as "input N (image k)"."""
        images = [
            (f"input {first_index + i}" + (f" (image {k})" if isinstance(item, InterleavedInput) else ""), data)
            for i, item in enumerate(items)
            for k, data in enumerate(input_images(item))
        ]
        self._check_images(engine, images)

    def check_rerank(self, engine: Engine, query: EmbedInput, documents: list, what: str = "documents") -> list:
        """A Rerank call's query and documents (texts, or images with their text): at least one document, no more
        than a call may carry, texts within --max-input-chars, images as check_images checks them (the documents
        named "input N" by their place in `what`, the query "the query"), the query's counted among the call's."""
        if not documents:
            raise InvalidInput(f"{what} is empty; send at least one document")
        self.check_batch(len(documents), what)
        images = [(f"input {index}", data) for index, item in enumerate(documents) for data in input_images(item)]
        images[:0] = [("the query", data) for data in input_images(query)]
        self._check_images(engine, images)
        self.check_chars(_text(query), "query")
        self.check_item_chars(documents, what)
        return documents

    def _check_images(self, engine: Engine, images: list[tuple[str, bytes]]) -> None:
        if not images:
            return
        if Modality.IMAGE not in engine.info.modalities:
            raise InvalidInput(
                f"model {engine.info.name} takes text only (ListModels modalities); {images[0][0]} is an image"
            )
        self.check_image_count(len(images))
        limit = engine.config.max_image_bytes
        for name, data in images:
            if len(data) > limit:
                # Worded for every face (no flag names): an HTTP caller cannot see the server's flags.
                raise InvalidInput(
                    f"{name}: the image has {len(data)} bytes, over this server's limit of {limit} "
                    "bytes per image; send a smaller or more compressed image"
                )
            if not data:
                raise InvalidInput(f"{name} is an empty image; send a PNG, JPEG or WebP file's bytes")

    def check_image_count(self, count: int) -> None:
        limit = self.config.max_images_per_request
        if count > limit:
            raise InvalidInput(
                f"the call carries {count} images; this server takes at most {limit} images per call: "
                "split them over several calls"
            )

    def check_texts(self, texts: list[str], what: str) -> list[str]:
        """check_inputs without the per-call limit, for a caller that runs the texts in slices within it."""
        if not texts:
            raise InvalidInput(f"{what} is empty; send at least one text")
        for index, text in enumerate(texts):
            self.check_chars(text, f"{what}[{index}]")
        return texts

    def check_batch(self, count: int, what: str = "inputs") -> None:
        if count > self.config.max_client_batch_size:
            raise InvalidInput(
                f"{what} holds {count} items, more than --max-client-batch-size {self.config.max_client_batch_size} "
                "allows in one call; split them over several calls"
            )

    def check_chars(self, text: str, what: str) -> None:
        limit = self.config.max_input_chars
        if len(text) > limit:
            raise InvalidInput(
                f"{what} has {len(text)} characters, more than the server's --max-input-chars {limit}; "
                "shorten or split it"
            )
        if not text.isascii():
            # JSON may carry a lone surrogate ("\ud800"), which is no text (protobuf refuses it already).
            try:
                text.encode()
            except UnicodeEncodeError as exc:
                raise InvalidInput(f"{what} is not valid Unicode ({exc.reason} at character {exc.start})") from None

    def check_candidate_labels(self, labels: list[str], template: str, num_inputs: int) -> int:
        """Zero-shot fields within the character limit; returns the sequences the call runs (one per input,
        or per input and candidate label), which count against --max-client-batch-size and in-flight."""
        for index, label in enumerate(labels):
            self.check_chars(label, f"candidate_labels[{index}]")
        self.check_chars(template, "hypothesis_template")
        pairs = num_inputs * max(len(labels), 1)
        if pairs > self.config.max_client_batch_size:
            raise InvalidInput(
                f"{num_inputs} inputs x {len(labels)} candidate_labels make {pairs} pairs, more than "
                f"--max-client-batch-size {self.config.max_client_batch_size}; split the call"
            )
        return pairs


def _text(item: EmbedInput) -> str:
    """An input's texts as one (the model reads them as one input): a text, an image's text, an interleaved
    input's texts."""
    return item if isinstance(item, str) else "".join(input_texts(item))
