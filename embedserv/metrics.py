"""Prometheus metrics, kept in embedserv's own registry (the server serves it on --metrics-port).

What code observes as it happens lives here: calls, tokens, latencies, batches. What is a state of the
moment (queue depth, KV cache, workers, inputs in flight) is read when Prometheus scrapes, by the
server's collector (server/metrics_endpoint.py), so nothing has to keep a gauge in step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, values

# The *_created series only double what Prometheus scrapes for no use here.
disable_created_metrics()
REGISTRY = CollectorRegistry()

# From 1 ms to 1 min: a short text's queue time up to a long generation.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SEQUENCES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

# protocol: grpc or http; rpc: the RPC (TEI's prefixed tei.v1.) or the HTTP route; status: the protocol's
# own (a gRPC code name, an HTTP status number).
REQUESTS = Counter(
    "embedserv_requests",
    "Calls by protocol, RPC or route, model and status",
    ["protocol", "rpc", "model", "status"],
    registry=REGISTRY,
)
INPUTS = Counter(
    "embedserv_request_inputs",
    "Inputs (texts, documents, prompts) of calls that succeeded",
    ["protocol", "rpc", "model"],
    registry=REGISTRY,
)
INPUT_TOKENS = Counter(
    "embedserv_input_tokens",
    "Tokens of the inputs of calls that succeeded",
    ["protocol", "rpc", "model"],
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter("embedserv_generated_tokens", "Tokens generated", ["model"], registry=REGISTRY)
QUEUE_SECONDS = Histogram(
    "embedserv_queue_seconds",
    "Time a call's first sequence waited for a batch",
    ["rpc", "model"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
TOKENIZATION_SECONDS = Histogram(
    "embedserv_tokenization_seconds",
    "Time a call spent tokenizing",
    ["rpc", "model"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
INFERENCE_SECONDS = Histogram(
    "embedserv_inference_seconds",
    "From a call's first batch starting to its last batch ending",
    ["rpc", "model"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
BATCH_SEQUENCES = Histogram(
    "embedserv_batch_sequences",
    "Sequences per forward pass (kind: prefill or generate step)",
    ["model", "kind"],
    buckets=_SEQUENCES,
    registry=REGISTRY,
)
BATCH_TOKENS = Histogram(
    "embedserv_batch_tokens",
    "Tokens per forward pass (kind: prefill or generate step)",
    ["model", "kind"],
    buckets=_TOKENS,
    registry=REGISTRY,
)


def value_class_from_environment() -> None:
    """Series labelled from now on keep their values as PROMETHEUS_MULTIPROC_DIR now says (in files there, or in
    memory). prometheus_client reads it when it is imported, and a front end forked by a zygote forked from the
    server (executor/zygote.py) has it imported from before the variable was set. Every series here has labels, so
    none was made before."""
    values.ValueClass = values.get_value_class()
