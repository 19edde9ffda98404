"""The bundled all-MiniLM-L6-v2 with sentence-transformers prompts, for the prompt-choice tests: its files linked
(the real weights, nothing built) beside a config_sentence_transformers.json that holds `prompts`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.models import bundled_model_dir

ST_CONFIG = "config_sentence_transformers.json"


def prompted_minilm(root: Path | str, prompts: dict[str, str]) -> Path:
    """A directory under `root` serving MiniLM with `prompts` (name -> text prepended)."""
    out = Path(root) / "minilm-with-prompts"
    out.mkdir(parents=True)
    for path in bundled_model_dir().iterdir():
        if path.name != ST_CONFIG:
            (out / path.name).symlink_to(path)
    (out / ST_CONFIG).write_text(json.dumps({"prompts": prompts}))
    return out
