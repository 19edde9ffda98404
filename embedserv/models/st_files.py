"""Reads a sentence-transformers model directory: modules, pooling, dense layers, prompts, limits.

Handles both the files sentence-transformers 2.x-5.x wrote (`pooling_mode_*_tokens` flags,
`max_seq_length` in sentence_bert_config.json) and 6.x (`pooling_mode`, `include_prompt`, the length in
tokenizer_config.json). A plain Hugging Face directory (no modules.json) is read as Transformer only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from embedserv.errors import ConfigError

_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
SUPPORTED_POOLING = ("cls", "mean", "max", "lasttoken")
# sentence-transformers Dense activations by their saved class path suffix.
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")


@dataclass(frozen=True)
class DenseSpec:
    in_features: int
    out_features: int
    bias: bool
    activation: str
    directory: Path


@dataclass(frozen=True)
class SentenceTransformerFiles:
    # None when the directory has no Pooling module (a plain Hugging Face model).
    pooling: str | None = None
    # False excludes prompt tokens from pooling.
    include_prompt: bool = True
    dense: tuple[DenseSpec, ...] = ()
    # From sentence_bert_config.json (older files); None defers to the tokenizer's limit.
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def _module_kind(module_type: str, modules_path: Path) -> str:
    """Transformer, Pooling, Dense, Normalize, ... of sentence-transformers' own modules. A module of another
    package is custom code: a class named Pooling there may pool differently, and its code never runs here."""
    if not module_type.startswith("sentence_transformers."):
        raise ConfigError(
            f"{modules_path}: module {module_type} is custom code, not a sentence-transformers module; "
            "embedserv never runs a model's own code"
        )
    return module_type.rsplit(".", 1)[-1]


def read_pooling(config: dict, path: Path) -> tuple[str, bool]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _LEGACY_POOLING_FLAGS.items() if config.get(flag)]
        if len(modes) != 1:
            raise ConfigError(f"{path}: exactly one pooling mode must be set, found {modes or 'none'}")
        mode = modes[0]
    if isinstance(mode, list):
        if len(mode) != 1:
            raise ConfigError(f"{path}: concatenated pooling modes {mode} are not supported")
        mode = mode[0]
    if mode not in SUPPORTED_POOLING:
        raise ConfigError(f"{path}: pooling mode {mode!r} is not supported; supported: {', '.join(SUPPORTED_POOLING)}")
    return mode, bool(config.get("include_prompt", True))


def read_dense(directory: Path) -> DenseSpec:
    config = _read_json(directory / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if activation not in DENSE_ACTIVATIONS:
        raise ConfigError(f"{directory}: Dense activation {activation!r} is not supported")
    return DenseSpec(
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=activation,
        directory=directory,
    )


def read_sentence_transformers(model_dir: Path) -> SentenceTransformerFiles:
    modules_path = model_dir / "modules.json"
    if not modules_path.exists():
        return SentenceTransformerFiles()
    pooling, include_prompt = None, True
    dense: list[DenseSpec] = []
    for module in _read_json(modules_path):
        kind = _module_kind(module["type"], modules_path)
        directory = model_dir / module.get("path", "")
        if kind == "Transformer":
            if module.get("path", ""):
                raise ConfigError(f"{modules_path}: the Transformer module must sit in the model's root directory")
        elif kind == "Pooling":
            pooling, include_prompt = read_pooling(_read_json(directory / "config.json"), directory)
        elif kind == "Dense":
            dense.append(read_dense(directory))
        elif kind != "Normalize":  # Normalize needs nothing: requests normalize by default
            raise ConfigError(f"{modules_path}: module {module['type']} is not supported")
    bert_config = model_dir / "sentence_bert_config.json"
    st_config = _read_json(bert_config) if bert_config.exists() else {}
    prompts_path = model_dir / "config_sentence_transformers.json"
    prompts_config = _read_json(prompts_path) if prompts_path.exists() else {}
    return SentenceTransformerFiles(
        pooling=pooling,
        include_prompt=include_prompt,
        dense=tuple(dense),
        max_seq_length=st_config.get("max_seq_length"),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        prompts=dict(prompts_config.get("prompts") or {}),
        default_prompt_name=prompts_config.get("default_prompt_name") or None,
    )
