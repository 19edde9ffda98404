"""Start-up mistakes end `embedserv serve` with exit code 2 and a message saying what to change.

Argument mistakes are found by what `embedserv serve` runs before it loads anything: the parser, the config
loader (cli.server_config) and the model's spec (models/spec.read_model_spec, which reads config.json and
picks the attention backend). Two checks need more: a busy port shows only when the server binds (cli.main
in this process, which stops there), and weights that only a worker process loads need the server and its
workers (a subprocess).
"""

from __future__ import annotations

import socket

import pytest
import torch

from embedserv.cli import build_parser, server_config
from embedserv.config import ServerConfig
from embedserv.errors import ConfigError
from embedserv.models.loading.spec_reader import read_model_spec
from tests.helpers.inprocess import serve_main
from tests.helpers.server import exit_code, free_port, launched_server


def _config(*args: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", "--host", "127.0.0.1", *args]))


def _read_spec(*args: str):
    (model,) = _config(*args).models
    return read_model_spec(model)


def test_busy_port_is_refused_not_shared(monkeypatch, caplog):
    """Found only at bind time, which comes before any model loads."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, log = serve_main(["--port", str(port)], monkeypatch, caplog)
    assert code == 2, log[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "--port" in log


def test_a_config_error_exits_2_with_its_message(monkeypatch, caplog):
    code, log = serve_main(["--port", str(free_port()), "--attention-backend", "nope"], monkeypatch, caplog)
    assert code == 2
    assert "unknown --attention-backend 'nope'" in log
    assert "Traceback" not in log


def test_name_count_must_match_model_count():
    with pytest.raises(ConfigError) as err:
        _config("--served-model-name", "a", "--served-model-name", "b")
    assert "2 --served-model-name for 1 --model" in str(err.value)


def test_unknown_attention_backend_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        _config("--attention-backend", "nope")
    assert "unknown --attention-backend 'nope'" in str(err.value)
    assert "sdpa" in str(err.value) and "naive" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="varlen can run on this machine")
def test_backend_that_cannot_run_here_says_why():
    with pytest.raises(ConfigError) as err:
        _read_spec("--attention-backend", "varlen")
    assert "--attention-backend varlen cannot run here: torch.nn.attention.varlen runs on CUDA only" in str(err.value)


def test_unknown_attention_kind_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exited:
        _config("--attention", "sideways")
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "--attention" in stderr and "causal" in stderr


def test_missing_model_directory():
    with pytest.raises(ConfigError) as err:
        _read_spec("--model", "/nonexistent/model")
    assert "no config.json" in str(err.value)


def test_weights_a_worker_cannot_load_stop_the_server_with_the_reason(bundled_dir, tmp_path):
    """The weights load only in the worker processes: the worker reports why it failed, the server exits 2.
    A subprocess: only a booted server's workers find this."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "broken"
    shutil.copytree(bundled_dir, model_dir)
    weights = load_file(str(bundled_dir / "model.safetensors"))
    missing = next(name for name in weights if name.endswith("attention.self.query.weight"))
    del weights[missing]
    save_file(weights, str(model_dir / "model.safetensors"))
    with launched_server(["--model", str(model_dir), "--data-parallel-size", "2"]) as (_, proc):
        code = exit_code(proc, 120)
        log = proc.log_path.read_text()
    assert code == 2, log[-2000:]
    assert "could not start" in log and str(model_dir) in log, log[-2000:]
