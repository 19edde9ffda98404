"""Fixtures of a test module whose `served` fixture is tests/helpers/inprocess.in_process_http_server's (gRPC
target, HTTP base URL, handle): import them into the module (pytest finds imported fixtures)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.client import RPC_TIMEOUT_S


@pytest.fixture(scope="module")
def target(served) -> str:
    """The server's gRPC address: e2e/conftest.py's `stub` connects to it."""
    return served[0]


@pytest.fixture(scope="module")
def http(served):
    """An HTTP client to the server's base URL."""
    with httpx.Client(base_url=served[1], timeout=RPC_TIMEOUT_S) as client:
        yield client
