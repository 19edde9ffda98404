"""API-key authentication (a server interceptor) and TLS credentials."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from embedserv.api_keys import KeyTable
from embedserv.errors import ConfigError
from embedserv.server.grpc.status import HEALTH_PREFIX, refusing


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but health needs metadata `authorization: Bearer <key>` with one of the server's keys; else
    UNAUTHENTICATED. (Which key, the call's tenant, is read again where the call starts: server/calls.py.)"""

    def __init__(self, keys: KeyTable) -> None:
        self._keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        return refusing(handler, handler_call_details.method, grpc.StatusCode.UNAUTHENTICATED, problem)

    def _problem(self, metadata) -> str | None:
        values = [value for key, value in metadata if key == "authorization"]
        return self._keys.match(values[0] if values else None, "metadata")[1]


def _read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path} is not a PEM file")
    return data


def _check_pair(cert: str, key: str, client_ca: str | None) -> None:
    """gRPC reports a bad certificate or key only as a failure to listen; ssl says which and why."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"--tls-cert {cert} and --tls-key {key} are not a usable certificate and matching key ({exc.reason})"
        ) from None
    if client_ca:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"--tls-client-ca {client_ca} holds no usable CA certificate ({exc.reason})") from None


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with the given chain and key; with `client_ca`, mutual TLS (clients must show a certificate)."""
    chain = _read_pem(cert, "--tls-cert")
    private_key = _read_pem(key, "--tls-key")
    root = _read_pem(client_ca, "--tls-client-ca") if client_ca else None
    _check_pair(cert, key, client_ca)
    return grpc.ssl_server_credentials(
        [(private_key, chain)], root_certificates=root, require_client_auth=root is not None
    )
