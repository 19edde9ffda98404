"""OpenTelemetry tracing, opt-in (--otlp-endpoint): one server span per call and its children, sent by OTLP/gRPC.

Off (the default) nothing is set up, nothing is imported from the SDK and nothing is sent: `start` returns
None. On, each process that answers calls (the server, or
each --frontends process) builds its own TracerProvider (a BatchSpanProcessor and an OTLP/gRPC exporter; the
standard OTEL_* environment applies: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS,
OTEL_PROPAGATORS...). The provider is this module's own, not the process-global one, so tests can install
an in-memory one per server.

The request span is a child of the caller's W3C `traceparent` (HTTP headers, gRPC metadata). Its children
(tokenization, queue, one span per batch the call's sequences ran in, response) are built afterwards from
timestamps the engine measured and returned with the call's Timing (its runs: perf_counter seconds, one
CLOCK_MONOTONIC clock for every process), so no span context crosses to the engine or worker processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from embedserv.types import EngineRun

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_owned: TracerProvider | None = None
# Whether calls are traced (a plain flag: a call that is not traced reads it and nothing more).
active = False
# perf_counter seconds -> epoch nanoseconds (the offset of this process's clocks, taken once).
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf_seconds: float) -> int:
    return int(perf_seconds * 1e9) + _EPOCH_OFFSET_NS


def setup(endpoint: str | None) -> bool:
    """Sets up export to `endpoint` (e.g. http://collector:4317) when one is given; True if it did."""
    global _owned
    if not endpoint or _owned is not None:
        return _owned is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Attributes given here beat the environment's, so the default name only applies when none is set.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "embedserv"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _owned = provider
    use_provider(provider)
    return True


def use_provider(provider: TracerProvider | None) -> None:
    """Traces calls with `provider` from now on (None: off). setup's way in, and the tests'."""
    global _tracer, _provider, active
    _provider = provider
    _tracer = provider.get_tracer("embedserv") if provider is not None else None
    active = _tracer is not None


def enabled() -> bool:
    return active


def shutdown() -> None:
    """Sends what is still batched and stops the provider setup() made (a server's stop)."""
    global _owned
    if _owned is not None:
        if _provider is _owned:
            use_provider(None)
        _owned.shutdown()
        _owned = None


@dataclass(frozen=True)
class _Step:
    started: float
    finished: float
    sequences: int
    tokens: int


@dataclass
class _EngineRun:
    """One pass of a call's sequences through the engine (a call may make several: rerank chunks...)."""

    received: float
    tokenized: float
    first_start: float
    steps: list[_Step] = field(default_factory=list)


class CallTrace:
    """The spans of one call; attributes and children are added when it ends."""

    def __init__(self, span: Span, received: float) -> None:
        self.span = span
        self.received = received
        self.runs: list[_EngineRun] = []
        self.answered_at: float | None = None

    def engine_ran(self, run: EngineRun) -> None:
        """One pass of the call's sequences through the engine (its outputs: engine/ports.py's SequenceOutputs)."""
        received, tokenized = run.received, run.tokenized
        steps = {}
        for output in run.outputs:
            # A cached output's step ran for an earlier call (before this one's queue began): not this call's.
            if output.finished > tokenized and (output.started, output.finished) not in steps:
                steps[output.started, output.finished] = _Step(
                    output.started, output.finished, output.batch_sequences, output.batch_tokens
                )
        ordered = sorted(steps.values(), key=lambda step: step.started)
        first_start = max(tokenized, ordered[0].started) if ordered else tokenized
        self.runs.append(_EngineRun(received, tokenized, first_start, ordered))

    def end(self, attributes: Mapping[str, object], error: str | None, ended: float) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        context = trace.set_span_in_context(self.span)
        for run in self.runs:
            _child("tokenization", context, run.received, run.tokenized)
            _child("queue", context, run.tokenized, run.first_start)
            for step in run.steps:
                _child(
                    "batch",
                    context,
                    step.started,
                    step.finished,
                    {
                        "embedserv.batch.sequences": step.sequences,
                        "embedserv.batch.tokens": step.tokens,
                    },
                )
        if self.answered_at is not None:
            _child("response", context, self.answered_at, ended)
        self.span.set_attributes(attributes)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=epoch_ns(ended))


def _child(name: str, context, start: float, end: float, attributes: Mapping[str, object] | None = None) -> None:
    span = _tracer.start_span(name, context=context, start_time=epoch_ns(start), attributes=attributes)
    span.end(end_time=epoch_ns(max(start, end)))


def start(name: str, received: float, carrier: Mapping[str, str], attributes: Mapping[str, object]) -> CallTrace | None:
    """The call's server span, a child of the caller's `traceparent` in `carrier`; None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    span = _tracer.start_span(
        name,
        context=propagate.extract(carrier),
        kind=SpanKind.SERVER,
        start_time=epoch_ns(received),
        attributes=attributes,
    )
    return CallTrace(span, received)
