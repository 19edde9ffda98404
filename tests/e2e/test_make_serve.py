"""`make serve` from the repository root starts a server that answers an Embed over gRPC and HTTP, with metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub, response_matrix
from tests.helpers.server import REPO_ROOT, free_port, server_env, stop_process, wait_until_serving

# The first `make serve` may install the project into .venv before serving.
START_TIMEOUT_S = 420


@pytest.mark.skipif(shutil.which("make") is None, reason="`make` is not installed on this machine")
def test_make_serve_answers_an_embed_over_grpc_and_http():
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    log_path = Path(tempfile.mkdtemp(prefix="embedserv-make-serve-")) / "make-serve.log"
    env = server_env()
    # The Makefile must find its own .venv, not inherit the one running pytest.
    env.pop("VIRTUAL_ENV", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["make", "serve", f"PORT={port}", f"HTTP_PORT={http_port}", f"METRICS_PORT={metrics_port}"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, killed as a whole below
        )
    try:
        target = f"127.0.0.1:{port}"
        wait_until_serving(target, lambda: proc.poll() is None, log_path, START_TIMEOUT_S, what="make serve")
        with grpc.insecure_channel(target) as channel:
            response = inference_stub(channel).Embed(embed_request(["make serve works"]), timeout=RPC_TIMEOUT_S)
        vector = response_matrix(response)
        assert vector.shape == (1, 384)
        assert abs(float(np.linalg.norm(vector[0])) - 1.0) < 1e-4
        assert response.usage.prompt_tokens > 0
        body = json.dumps({"input": "make serve works"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/embeddings", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=RPC_TIMEOUT_S) as reply:
            over_http = json.loads(reply.read())["data"][0]["embedding"]
        np.testing.assert_allclose(np.array(over_http, dtype=np.float32), vector[0], rtol=0, atol=0)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=RPC_TIMEOUT_S) as reply:
            assert b"embedserv_" in reply.read()
    finally:
        stop_process(proc, group=True)
