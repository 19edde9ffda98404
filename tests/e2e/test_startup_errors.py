"""Start-up mistakes end the process with exit code 2 and a message saying what to change."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers.server import REPO_ROOT, free_port, server_env


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=timeout)


def test_busy_port_is_refused_not_shared():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _serve("--port", str(port))
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "--port" in result.stderr


def test_name_count_must_match_model_count():
    result = _serve("--port", str(free_port()), "--served-model-name", "a", "--served-model-name", "b")
    assert result.returncode == 2
    assert "2 --served-model-name for 1 --model" in result.stderr


def test_unknown_attention_backend_lists_the_choices():
    result = _serve("--port", str(free_port()), "--attention-backend", "nope")
    assert result.returncode == 2
    assert "unknown --attention-backend 'nope'" in result.stderr
    assert "sdpa" in result.stderr and "naive" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="varlen can run on this machine")
def test_backend_that_cannot_run_here_says_why():
    result = _serve("--port", str(free_port()), "--attention-backend", "varlen")
    assert result.returncode == 2
    assert "--attention-backend varlen cannot run here: torch.nn.attention.varlen runs on CUDA only" in result.stderr


def test_unknown_attention_kind_is_refused_by_the_parser():
    result = _serve("--port", str(free_port()), "--attention", "sideways")
    assert result.returncode == 2
    assert "--attention" in result.stderr and "causal" in result.stderr


def test_missing_model_directory():
    result = _serve("--port", str(free_port()), "--model", "/nonexistent/model")
    assert result.returncode == 2
    assert "no config.json" in result.stderr


def test_weights_a_worker_cannot_load_stop_the_server_with_the_reason(bundled_dir, tmp_path):
    """The weights load only in the worker processes: the worker reports why it failed, the server exits 2."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "broken"
    shutil.copytree(bundled_dir, model_dir)
    weights = load_file(str(bundled_dir / "model.safetensors"))
    missing = next(name for name in weights if name.endswith("attention.self.query.weight"))
    del weights[missing]
    save_file(weights, str(model_dir / "model.safetensors"))
    result = _serve("--port", str(free_port()), "--model", str(model_dir), "--data-parallel-size", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "could not start" in result.stderr and str(model_dir) in result.stderr, result.stderr[-2000:]
