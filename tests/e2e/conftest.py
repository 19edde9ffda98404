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
