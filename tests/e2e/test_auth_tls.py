"""A server with an API key (flag, then environment) and with mutual TLS, configured by `embedserv serve` flags.

Three in-process servers (tests/helpers/inprocess.py) with the bundled all-MiniLM-L6-v2: --api-key,
EMBEDSERV_API_KEY only, and --tls-cert/--tls-key/--tls-client-ca with a CA, server and client certificate made here.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.helpers.client import embed_request, inference_stub, response_matrix
from tests.helpers.compare import assert_unit_norm
from tests.helpers.inprocess import in_process_server
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, health_status, open_channel
from tests.helpers.tls import make_pki

SERVED = "minilm"
DIMENSION = 384
RPC_TIMEOUT_S = 60.0
FLAG_KEY = "flag-key-4f1c"
ENV_KEY = "env-key-9b2e"


def _server_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--served-model-name", SERVED, "--device", "cpu", *extra]


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _embed_code(stub, metadata=None) -> grpc.StatusCode:
    """OK with a unit-norm [1, DIMENSION] answer, else the refusal's code."""
    try:
        reply = stub.Embed(embed_request(["hello world"]), metadata=metadata, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code()
    matrix = response_matrix(reply)
    assert matrix.shape == (1, DIMENSION)
    assert_unit_norm(matrix)
    return grpc.StatusCode.OK


# ---- API key -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def key_server(bundled_dir):
    # The flag wins over an environment key; a stale one in the environment must not be what works.
    metrics_port = free_port()
    args = _server_args(bundled_dir, "--api-key", FLAG_KEY, "--metrics-port", str(metrics_port))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EMBEDSERV_API_KEY", "stale")
        with in_process_server(args) as (target, proc):
            yield target, proc, metrics_port


@pytest.fixture(scope="module")
def key_stub(key_server):
    target, _, _ = key_server
    with grpc.insecure_channel(target) as channel:
        yield inference_stub(channel)


@pytest.mark.parametrize(
    ("metadata", "hint"),
    [
        pytest.param(None, "Bearer <key>", id="no-key"),
        pytest.param(_bearer("wrong"), "API key is wrong", id="wrong-key"),
        pytest.param(_bearer("stale"), "API key is wrong", id="env-key-beside-flag"),
        pytest.param((("authorization", FLAG_KEY),), "Bearer <key>", id="no-scheme"),
    ],
)
def test_embed_and_list_models_refuse_without_the_right_key(key_stub, metadata, hint):
    from embedserv.v1 import embedserv_pb2 as pb

    calls = {
        "Embed": lambda: key_stub.Embed(embed_request(["hello"]), metadata=metadata, timeout=RPC_TIMEOUT_S),
        "ListModels": lambda: key_stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S),
        "EmbedStream": lambda: list(
            key_stub.EmbedStream(iter([embed_request(["hello"])]), metadata=metadata, timeout=RPC_TIMEOUT_S)
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert hint in caught.value.details(), name


def test_right_key_is_served(key_stub):
    from embedserv.v1 import embedserv_pb2 as pb

    assert _embed_code(key_stub, _bearer(FLAG_KEY)) == grpc.StatusCode.OK
    reply = key_stub.ListModels(pb.ListModelsRequest(), metadata=_bearer(FLAG_KEY), timeout=RPC_TIMEOUT_S)
    assert [m.name for m in reply.models] == [SERVED]


def test_health_needs_no_key(key_server):
    target, _, _ = key_server
    assert health_status(target) == "SERVING"
    assert health_status(target, service=SERVED) == "SERVING"


def test_key_stays_out_of_the_log(key_server, key_stub):
    _embed_code(key_stub, _bearer("wrong"))
    _, proc, _ = key_server
    assert FLAG_KEY not in proc.log_path.read_text(errors="replace")


def test_refusals_are_counted_and_metrics_need_no_key(key_server, key_stub):
    _, _, metrics_port = key_server
    labels = dict(protocol="grpc", rpc="Embed", model="", status="UNAUTHENTICATED")
    before = scrape(metrics_port).value("embedserv_requests_total", **labels)
    assert _embed_code(key_stub, _bearer("wrong")) == grpc.StatusCode.UNAUTHENTICATED
    assert _embed_code(key_stub) == grpc.StatusCode.UNAUTHENTICATED
    assert scrape(metrics_port).value("embedserv_requests_total", **labels) - before == 2


def test_key_from_the_environment(bundled_dir, monkeypatch):
    """Without --api-key the server takes EMBEDSERV_API_KEY (which keeps the key out of `ps`)."""
    monkeypatch.setenv("EMBEDSERV_API_KEY", ENV_KEY)
    with in_process_server(_server_args(bundled_dir)) as (target, _):
        with grpc.insecure_channel(target) as channel:
            stub = inference_stub(channel)
            assert _embed_code(stub, _bearer(ENV_KEY)) == grpc.StatusCode.OK
            assert _embed_code(stub) == grpc.StatusCode.UNAUTHENTICATED
            assert _embed_code(stub, _bearer(FLAG_KEY)) == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(target) == "SERVING"


@pytest.fixture(scope="module")
def mtls_server(bundled_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    pems = make_pki(directory)
    with_client_cert = grpc.ssl_channel_credentials(
        root_certificates=pems["ca"], private_key=pems["client_key"], certificate_chain=pems["client_cert"]
    )
    http_port = free_port()
    args = _server_args(
        bundled_dir,
        "--tls-cert", str(directory / "server_cert.pem"), "--tls-key", str(directory / "server_key.pem"),
        "--tls-client-ca", str(directory / "ca.pem"), "--http-port", str(http_port),
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.delenv("EMBEDSERV_API_KEY", raising=False)
        with in_process_server(args) as (target, _):
            yield target, pems, with_client_cert, directory, http_port


def test_http_is_https_with_the_same_mutual_tls(mtls_server):
    import ssl

    import httpx

    _, _, _, directory, http_port = mtls_server
    url = f"https://127.0.0.1:{http_port}/v1/embeddings"
    context = ssl.create_default_context(cafile=str(directory / "ca.pem"))
    context.load_cert_chain(str(directory / "client_cert.pem"), str(directory / "client_key.pem"))
    reply = httpx.post(url, json={"input": "over https"}, verify=context, timeout=30)
    assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == 384
    no_client_cert = ssl.create_default_context(cafile=str(directory / "ca.pem"))
    with pytest.raises(httpx.HTTPError):
        httpx.post(url, json={"input": "no client certificate"}, verify=no_client_cert, timeout=30)
    with pytest.raises(httpx.HTTPError):
        httpx.post(url.replace("https", "http"), json={"input": "plaintext"}, timeout=30)


def test_tls_with_a_client_certificate_is_served(mtls_server):
    target, _, with_client_cert, _, _ = mtls_server
    with open_channel(target, with_client_cert) as channel:
        assert _embed_code(inference_stub(channel)) == grpc.StatusCode.OK


def test_tls_without_a_client_certificate_is_refused(mtls_server):
    target, pems, *_ = mtls_server
    with open_channel(target, grpc.ssl_channel_credentials(root_certificates=pems["ca"])) as channel:
        assert _embed_code(inference_stub(channel)) == grpc.StatusCode.UNAVAILABLE


def test_plaintext_is_refused_by_a_tls_server(mtls_server):
    target, *_ = mtls_server
    with grpc.insecure_channel(target) as channel:
        assert _embed_code(inference_stub(channel)) == grpc.StatusCode.UNAVAILABLE
    assert health_status(target) == "UNAVAILABLE"


def test_client_certificate_from_another_ca_is_refused(mtls_server, tmp_path):
    """The server checks the client's certificate against --tls-client-ca, not merely that there is one."""
    target, pems, *_ = mtls_server
    other = make_pki(tmp_path)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pems["ca"], private_key=other["client_key"], certificate_chain=other["client_cert"]
    )
    with open_channel(target, credentials) as channel:
        assert _embed_code(inference_stub(channel)) == grpc.StatusCode.UNAVAILABLE
