"""The ServerConfig `embedserv serve` builds from flags and, when given, a --config file's text."""

from __future__ import annotations

from pathlib import Path

from embedserv.cli import build_parser, server_config
from embedserv.config import ServerConfig


def serve_config(tmp_path: Path, args: list[str], file: str | None = None) -> ServerConfig:
    if file is not None:
        path = tmp_path / "embedserv.yaml"
        path.write_text(file)
        args = ["--config", str(path), *args]
    return server_config(build_parser().parse_args(["serve", *args]))
