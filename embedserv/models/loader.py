"""Builds a native model from a Hugging Face directory and fills it from safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.layers import pack_linears


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the index's shards when sharded, else model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ConfigError(
        f"{model_dir} has no model.safetensors; convert the checkpoint to safetensors "
        "(pickle checkpoints are not loaded)"
    )


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_into(model: nn.Module, files: list[Path]) -> None:
    """Fills every parameter of `model` (built on the target device) or says what is missing."""
    loaded = model.load_weights(iterate_weights(files))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"checkpoint {files[0].parent} lacks {len(missing)} parameters: {shown}")


def build_model(model_class: type[nn.Module], hf_config, files: list[Path], device: torch.device, dtype) -> nn.Module:
    """Constructs without initializing (meta device), then allocates on `device` and loads weights."""
    try:
        with torch.device("meta"):
            model = model_class(hf_config)
        model = model.to_empty(device=device).to(dtype)
        load_into(model, files)
    except ValueError as exc:
        # What the model classes refuse (an unsupported rope type, a tensor the config does not fit) is a
        # start-up error about this model, not a crash.
        raise ConfigError(f"{files[0].parent}: {exc}") from exc
    model.eval().requires_grad_(False)
    pack_linears(model)
    return model


def load_dense_weights(dense: nn.Module, directory: Path) -> None:
    """sentence-transformers Dense: `linear.weight` / `linear.bias` in the module's own folder."""
    path = directory / "model.safetensors"
    if not path.exists():
        raise ConfigError(f"{directory} has no model.safetensors for its Dense layer")
    state = dict(iterate_weights([path]))
    dense.load_state_dict(state)
