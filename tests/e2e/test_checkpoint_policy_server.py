"""`embedserv serve` refuses a pickle-only model unless --allow-pickle, before it loads anything."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tests.helpers.inprocess import serve_main
from tests.helpers.server import free_port


def test_pickle_only_model_exits_2_naming_allow_pickle(tiny_encoder, tmp_path, monkeypatch, caplog):
    """Through cli.main in this process: the refusal comes before any worker starts."""
    source = tiny_encoder("bert", "mean")
    model_dir = tmp_path / "pickled"
    shutil.copytree(source, model_dir)
    torch.save(load_file(str(model_dir / "model.safetensors")), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    code, log = serve_main(
        ["--port", str(free_port()), "--model", str(model_dir), "--device", "cpu"], monkeypatch, caplog
    )
    assert code == 2, log[-2000:]
    assert "--allow-pickle" in log and "pytorch_model.bin" in log, log[-2000:]
    assert "Traceback" not in log
