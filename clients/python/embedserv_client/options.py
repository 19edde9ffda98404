"""How the client connects and retries: TLS, the channel's options, the API key, the backoff policy."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

PemSource = str | bytes | Path


@dataclass(frozen=True)
class Tls:
    """TLS to the server. `ca`: PEM (bytes) or a PEM file path; None trusts the system's roots.

    `cert` and `key` (both or neither) are the client's certificate for a server with --tls-client-ca.
    `server_name` overrides the name checked against the server's certificate."""

    ca: PemSource | None = None
    cert: PemSource | None = None
    key: PemSource | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("Tls needs both cert and key for a client certificate, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca), private_key=_pem(self.key), certificate_chain=_pem(self.cert)
        )


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter for calls the server refused without running them.

    UNAVAILABLE (a replica starting, draining or gone) and RESOURCE_EXHAUSTED (a server at its
    --max-concurrent-requests) are retried; other codes are the caller's to fix. A retry never
    outlives the call's timeout."""

    # Waits of about 0.1, 0.2, 0.4, 0.8, 1.6 s (each 50-100% of that): a replica restarting or a burst
    # past the server's limit has ~1.5-3 s to clear before the call fails.
    max_attempts: int = 6
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    retryable: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1 (1: no retries)")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff or self.multiplier < 1:
            raise ValueError("RetryPolicy needs 0 <= initial_backoff <= max_backoff and multiplier >= 1")

    def delay(self, code: grpc.StatusCode, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up and raise."""
        if code not in self.retryable or attempt >= self.max_attempts:
            return None
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        # Half fixed, half random: spread the retries of many clients that failed together.
        wait = ceiling * (0.5 + random.random() / 2)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


NO_RETRY = RetryPolicy(max_attempts=1)


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float | None:
    """The timeout for the next attempt: what is left of the call's deadline (never below 1 ms)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def channel_options(load_balancing: str | None) -> list[tuple[str, object]]:
    """Responses are bounded by the request (a 256-input embed of 4096 floats is 4 MiB), so lift the
    4 MiB default receive limit; the server's own receive limit bounds what we send."""
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
    ]
    if load_balancing:
        # Round robin over every address the name resolves to: one connection per replica behind a
        # headless Service (dns:///name.namespace.svc.cluster.local:50051), calls spread across them.
        config: dict[str, object] = {"loadBalancingConfig": [{load_balancing: {}}]}
        options.append(("grpc.service_config", json.dumps(config)))
    return options


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return () if not api_key else (("authorization", f"Bearer {api_key}"),)


def tls_credentials(tls: bool | Tls | None) -> grpc.ChannelCredentials | None:
    """None for plaintext; `True` is TLS with the system's roots."""
    if not tls:
        return None
    return (tls if isinstance(tls, Tls) else Tls()).credentials()


def channel_args(
    target: str, tls: bool | Tls | None, load_balancing: str | None, extra: list[tuple[str, object]]
) -> dict:
    """What grpc.{,aio.}{secure,insecure}_channel take, less the function itself."""
    options = channel_options(load_balancing) + extra
    if isinstance(tls, Tls) and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    args: dict = {"target": target, "options": options}
    credentials = tls_credentials(tls)
    if credentials is not None:
        args["credentials"] = credentials
    return args
