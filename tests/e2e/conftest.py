"""Fixtures shared by the server tests: the generated messages module and a stub to a module's `target`."""

from __future__ import annotations

import grpc
import pytest

from tests.helpers.client import inference_stub


@pytest.fixture(scope="module")
def pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


@pytest.fixture(scope="module")
def stub(target):
    """A stub over an insecure channel to the module's `target` fixture (its server's address)."""
    with grpc.insecure_channel(target) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory):
    """One in-process server with gRPC and HTTP for every API-compatibility test (tests/helpers/compat_server.py)."""
    from tests.helpers.compat_server import CompatServer, build_models, server_args
    from tests.helpers.inprocess import in_process_server
    from tests.helpers.server import free_port

    models = build_models(tmp_path_factory.mktemp("compat-models"))
    http_port = free_port()
    with in_process_server(server_args(models, http_port)) as (target, handle):
        yield CompatServer(target, f"http://127.0.0.1:{http_port}", http_port, models, handle.log_path)
