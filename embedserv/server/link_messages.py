"""The messages between the front-end processes and the engine process (`--frontends N`), sent through the
workers' codec (executor/codec.py: typed dataclasses as msgpack plus raw array frames; no pickle).

front end -> engine: Hello once, then InferCall / GenerateCall per call, CancelCall when the caller went away,
Drained when its own drain is done. engine -> front end: InferDone or CallFailed per InferCall; GenerateDelta
per delta and then GenerateEnd or CallFailed per GenerateCall; Status whenever serving changes (and each
second); Drain when the server drains, CancelAll on a second signal.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.ports import CoreStatus, SequenceOutput
from embedserv.errors import AdapterNotFound, EmbedservError, InvalidInput, ModelNotFound, NotReady, Overloaded
from embedserv.executor.codec import Codec
from embedserv.types import EmbedOutput, GenerationDelta, SamplingParams, Timing


@dataclass(frozen=True)
class Hello:
    """Sent once the front end listens, or with why it cannot (its ports: a ConfigError's message)."""

    index: int
    pid: int
    error: str = ""


@dataclass(frozen=True)
class InferCall:
    call_id: int
    model: str
    sequences: list[InputSequence]
    # perf_counter seconds when the front end received the call (CLOCK_MONOTONIC: one clock for all processes).
    received: float
    wanted: tuple[EmbedOutput, ...] = ()
    # The call's x-request-id, for the engine's log lines (logs.REQUEST_ID).
    request_id: str = ""
    # False: neither read nor fill the model's embedding cache (EmbedParams.bypass_cache).
    use_cache: bool = True
    # The call's class (call_class.CALL_CLASS): its priority (None: the model's default) and tenant.
    priority: int | None = None
    tenant: str = ""


@dataclass(frozen=True)
class InferDone:
    call_id: int
    outputs: list[SequenceOutput]
    tokens: int
    timing: Timing


@dataclass(frozen=True)
class GenerateCall:
    call_id: int
    model: str
    prompt: str | list[int]
    params: SamplingParams
    decoder_prompt: str = ""
    add_special_tokens: bool = True
    request_id: str = ""
    priority: int | None = None
    tenant: str = ""
    stream: bool = True


@dataclass(frozen=True)
class GenerateDelta:
    call_id: int
    delta: GenerationDelta


@dataclass(frozen=True)
class GenerateEnd:
    call_id: int


@dataclass(frozen=True)
class CallFailed:
    call_id: int
    # The embedserv.errors class the engine raised (the front end raises the same, so the status code
    # matches a one-process server's); "internal" for anything else.
    error: str
    message: str


@dataclass(frozen=True)
class CancelCall:
    call_id: int


@dataclass(frozen=True)
class Status:
    # Every model loaded and started (the server's own health turns SERVING with it).
    started: bool
    # Each model's, by served name.
    models: dict[str, CoreStatus]


@dataclass(frozen=True)
class Drain:
    grace: float


@dataclass(frozen=True)
class Drained:
    index: int


@dataclass(frozen=True)
class CancelAll:
    pass


CODEC = Codec([
    Hello, InferCall, InferDone, GenerateCall, GenerateDelta, GenerateEnd, CallFailed, CancelCall, Status, Drain,
    Drained, CancelAll,
])  # fmt: skip

_ERRORS: dict[str, type[EmbedservError]] = {
    cls.__name__: cls for cls in (InvalidInput, ModelNotFound, AdapterNotFound, NotReady, Overloaded)
}


def failure(call_id: int, exc: BaseException) -> CallFailed:
    name = type(exc).__name__
    if name in _ERRORS:
        return CallFailed(call_id, name, str(exc))
    return CallFailed(call_id, "internal", f"{name}: {exc}")


def error_of(failed: CallFailed) -> Exception:
    """The exception a one-process server would have raised (a RuntimeError for internal errors)."""
    return _ERRORS.get(failed.error, RuntimeError)(failed.message)
