"""`embedserv serve` refuses a pickle-only model unless --allow-pickle, before it loads anything."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.helpers.server import REPO_ROOT, free_port, server_env


def test_pickle_only_model_exits_2_naming_allow_pickle(tiny_encoder, tmp_path):
    source = tiny_encoder("bert", "mean")
    model_dir = tmp_path / "pickled"
    shutil.copytree(source, model_dir)
    torch.save(load_file(str(model_dir / "model.safetensors")), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    cmd = [
        sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
        "--model", str(model_dir), "--device", "cpu",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--allow-pickle" in result.stderr and "pytorch_model.bin" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
