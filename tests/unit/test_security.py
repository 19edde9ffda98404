"""API-key interceptor and TLS credential loading, on an in-process grpc.aio server with no model.

A small generic service (identity handlers on raw bytes, in every call shape the interceptor must
mirror) and the standard health service run behind ApiKeyInterceptor on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from embedserv.api_keys import ApiKey, KeyTable
from embedserv.errors import ConfigError
from embedserv.server.security import ApiKeyInterceptor, server_credentials
from tests.helpers.aio import run_async
from tests.helpers.tls import make_pki

KEY = "s3cret-key"
SERVICE = "test.Echo"
TIMEOUT_S = 10.0
# Names of the handlers that ran: a refused call must never reach one.
RAN: list[str] = []


async def _unary(request: bytes, context) -> bytes:
    RAN.append("Unary")
    return request


async def _client_stream(requests, context) -> bytes:
    RAN.append("ClientStream")
    return b"".join([r async for r in requests])


async def _server_stream(request: bytes, context):
    RAN.append("ServerStream")
    for _ in range(2):
        yield request


async def _bidi(requests, context):
    RAN.append("Bidi")
    async for request in requests:
        yield request


def _echo_handler() -> grpc.GenericRpcHandler:
    # No (de)serializers: requests and responses are the raw bytes.
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream),
            "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(_bidi),
        },
    )


@contextlib.asynccontextmanager
async def _channel_to_server() -> AsyncIterator[grpc.aio.Channel]:
    """An insecure channel to a fresh server with the interceptor; the server stops on exit."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(KeyTable((ApiKey("default", KEY),), 10))])
    server.add_generic_rpc_handlers([_echo_handler()])
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(grace=None)


async def _call(channel: grpc.aio.Channel, shape: str, metadata, stream: tuple[bytes, ...]) -> list[bytes]:
    """One call of the given shape (`stream` is the request stream of the streaming shapes); returns every
    response message."""
    method = f"/{SERVICE}/{shape}"
    kwargs = dict(metadata=metadata, timeout=TIMEOUT_S)
    if shape == "Unary":
        return [await channel.unary_unary(method)(b"ping", **kwargs)]
    if shape == "ClientStream":
        return [await channel.stream_unary(method)(iter(stream), **kwargs)]
    if shape == "ServerStream":
        return [r async for r in channel.unary_stream(method)(b"ping", **kwargs)]
    return [r async for r in channel.stream_stream(method)(iter(stream), **kwargs)]


EXPECTED = {
    "Unary": [b"ping"],
    "ClientStream": [b"pingpong"],
    "ServerStream": [b"ping", b"ping"],
    "Bidi": [b"ping", b"pong"],
}

# (metadata sent, what the refusal must tell the caller)
REFUSED = [
    pytest.param(None, "send metadata 'authorization: Bearer <key>'", id="no-metadata"),
    pytest.param((("x-other", "1"),), "send metadata 'authorization: Bearer <key>'", id="other-metadata-only"),
    pytest.param((("authorization", "Bearer wrong"),), "send the key the server was started with", id="wrong-key"),
    pytest.param((("authorization", f"Basic {KEY}"),), "must read 'Bearer <key>'", id="basic-scheme"),
    pytest.param((("authorization", "Bearer"),), "must read 'Bearer <key>'", id="bearer-without-key"),
    pytest.param((("authorization", KEY),), "must read 'Bearer <key>'", id="key-without-scheme"),
]


@pytest.mark.parametrize("shape", list(EXPECTED))
@pytest.mark.parametrize(("metadata", "hint"), REFUSED)
@run_async
async def test_missing_or_wrong_credentials_are_unauthenticated_with_a_hint(shape, metadata, hint):
    RAN.clear()
    async with _channel_to_server() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            # An empty request stream: grpc.aio's client may report INTERNAL instead of the server's status
            # when it writes a message after the server ended the call (grpc/grpc#36066), a client race.
            await _call(channel, shape, metadata, stream=())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
    assert hint in caught.value.details()
    assert RAN == [], "a refused call reached its handler"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
@run_async
async def test_right_key_passes_every_call_shape(scheme):
    """The scheme is case-insensitive (RFC 6750); the handlers see and answer the request unchanged."""
    async with _channel_to_server() as channel:
        for shape, expected in EXPECTED.items():
            metadata = (("authorization", f"{scheme} {KEY}"),)
            assert await _call(channel, shape, metadata, stream=(b"ping", b"pong")) == expected, shape


@run_async
async def test_health_needs_no_key():
    """Kubernetes probes and load balancers carry no credentials."""
    async with _channel_to_server() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        first = await watch.read()
        watch.cancel()
        assert first.status == health_pb2.HealthCheckResponse.SERVING


@run_async
async def test_unknown_method_with_right_key_is_unimplemented_not_unauthenticated():
    async with _channel_to_server() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Nope")(
                b"x", metadata=(("authorization", f"Bearer {KEY}"),), timeout=TIMEOUT_S
            )
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _pem(path, label: str = "CERTIFICATE"):
    # Only the PEM armour matters here: server_credentials reads and checks files, grpc parses them later.
    path.write_text(f"-----BEGIN {label}-----\nAAAA\n-----END {label}-----\n")
    return str(path)


def _pem_files(tmp_path) -> dict[str, str]:
    return {
        "--tls-cert": _pem(tmp_path / "cert.pem"),
        "--tls-key": _pem(tmp_path / "key.pem", "PRIVATE KEY"),
        "--tls-client-ca": _pem(tmp_path / "ca.pem"),
    }


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_missing_tls_file_names_its_flag_and_path(tmp_path, flag):
    files = _pem_files(tmp_path)
    files[flag] = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as caught:
        server_credentials(files["--tls-cert"], files["--tls-key"], files["--tls-client-ca"])
    assert flag in str(caught.value) and "absent.pem" in str(caught.value)


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-client-ca"])
def test_non_pem_tls_file_names_its_flag(tmp_path, flag):
    files = _pem_files(tmp_path)
    der = tmp_path / "der.bin"
    der.write_bytes(b"\x30\x82\x01\x0a\x02\x82\x01\x01\x00")  # what a DER certificate starts with
    files[flag] = str(der)
    with pytest.raises(ConfigError) as caught:
        server_credentials(files["--tls-cert"], files["--tls-key"], files["--tls-client-ca"])
    assert flag in str(caught.value) and "PEM" in str(caught.value)


def test_directory_instead_of_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--tls-cert"):
        server_credentials(str(tmp_path), _pem(tmp_path / "key.pem", "PRIVATE KEY"), None)


def test_pem_files_give_server_credentials(tmp_path):
    """Without a client CA, too (server-only TLS)."""
    make_pki(tmp_path)
    cert, key, ca = (str(tmp_path / f"{name}.pem") for name in ("server_cert", "server_key", "ca"))
    assert isinstance(server_credentials(cert, key, None), grpc.ServerCredentials)
    assert isinstance(server_credentials(cert, key, ca), grpc.ServerCredentials)


def test_a_key_that_does_not_match_the_certificate_names_both_flags(tmp_path):
    """gRPC itself would only fail to listen, which read as a busy port."""
    make_pki(tmp_path)
    with pytest.raises(ConfigError, match="--tls-cert .* and --tls-key .* are not a usable certificate and matching"):
        server_credentials(str(tmp_path / "server_cert.pem"), str(tmp_path / "client_key.pem"), None)


def test_pem_armour_around_garbage_is_refused(tmp_path):
    make_pki(tmp_path)
    with pytest.raises(ConfigError, match="--tls-cert"):
        server_credentials(_pem(tmp_path / "fake.pem"), str(tmp_path / "server_key.pem"), None)
    with pytest.raises(ConfigError, match="--tls-client-ca"):
        server_credentials(
            str(tmp_path / "server_cert.pem"), str(tmp_path / "server_key.pem"), _pem(tmp_path / "fake_ca.pem")
        )
