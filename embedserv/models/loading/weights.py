"""The one weight loader: checkpoint tensors into a model's parameters, by its family's CheckpointNames.

Every family loads through `load_weights`; a family file only declares its names (loading/family.py).
Packed parameters (q/k/v -> qkv, gate/up -> gate_up) are Linears whose `shard_sizes` give each shard's
rows; such a parameter counts as loaded only once every one of its shards was.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.layers import copy_checked, pack_linears
from embedserv.models.loading.checkpoint import checkpoint_files, iterate_weights
from embedserv.models.loading.family import CheckpointNames, Family
from embedserv.models.loading.meta import meta_model


class _Names:
    """CheckpointNames compiled once per load."""

    def __init__(self, names: CheckpointNames) -> None:
        self.prefixes = names.prefixes
        self.ignored = re.compile(names.ignored) if names.ignored else None
        self.packed = names.packed
        self.renames = [(re.compile(pattern), replacement) for pattern, replacement in names.renames]

    def ours(self, name: str) -> tuple[str | None, int | None]:
        """(our parameter name, shard index or None); (None, None) for a tensor to skip."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if self.ignored is not None and self.ignored.match(name):
            return None, None
        shard = None
        for fragment, packed, index in self.packed:
            if fragment in name:
                name, shard = name.replace(fragment, packed, 1), index
                break
        for pattern, replacement in self.renames:
            name = pattern.sub(replacement, name)
        return name, shard


def compiled_names(family: Family, hf_config) -> _Names:
    """The family's checkpoint names, compiled: `.ours(name)` maps a checkpoint name (PEFT adapters' targets
    go through it too, loading/lora_files.py)."""
    return _Names(family.checkpoint_names(hf_config))


def _shard_rows(model: nn.Module, target: str, shard: int, checkpoint_name: str) -> slice:
    sizes = getattr(model.get_submodule(target.rsplit(".", 1)[0]), "shard_sizes", ())
    if shard >= len(sizes):
        raise ValueError(f"unexpected checkpoint tensor {checkpoint_name!r}: {target} has {len(sizes)} shard(s)")
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


def load_weights(model: nn.Module, family: Family, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copies checkpoint tensors into `model` (parameters and buffers); returns the names it filled.

    Refuses a tensor the model has no place for, or one whose shape differs from the config's (ValueError).
    """
    model.fill_defaults()
    names = compiled_names(family, model.config)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    loaded: set[str] = set()
    shards: dict[str, set[int]] = {}
    for checkpoint_name, tensor in weights:
        name, shard = names.ours(checkpoint_name)
        if name is None:
            continue
        if name not in targets:
            raise ValueError(f"unexpected checkpoint tensor {checkpoint_name!r}")
        if shard is None:
            copy_checked(targets[name].data, tensor, checkpoint_name)
            loaded.add(name)
            continue
        copy_checked(targets[name].data[_shard_rows(model, name, shard, checkpoint_name)], tensor, checkpoint_name)
        shards.setdefault(name, set()).add(shard)
    for name, filled in shards.items():
        if len(filled) == len(model.get_submodule(name.rsplit(".", 1)[0]).shard_sizes):
            loaded.add(name)
    return loaded


def load_into(model: nn.Module, family: Family, files: list[Path]) -> None:
    """Fills every parameter of `model` (built on the target device) or says what is missing."""
    loaded = load_weights(model, family, iterate_weights(files))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"checkpoint {files[0].parent} lacks {len(missing)} parameters: {shown}")


def _allocated(model: nn.Module, device: torch.device, dtype) -> nn.Module:
    """`model.to_empty(device=device).to(dtype)` in one pass: each meta tensor becomes uninitialized memory on
    `device`, floating-point ones directly in `dtype`. (to_empty's empty_like on meta tensors imports torch's
    symbolic-shapes module, about 0.6 s of every worker's start; and a separate .to() copies every weight.)"""
    return model._apply(
        lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
    )


def build_model(family: Family, hf_config, files: list[Path], device: torch.device, dtype) -> nn.Module:
    """Constructs without initializing (meta device), then allocates on `device` and loads weights."""
    try:
        with meta_model():
            model = family.model_class(hf_config)
        model = _allocated(model, device, dtype)
        load_into(model, family, files)
    except ValueError as exc:
        # What the model classes refuse (an unsupported rope type, a tensor the config does not fit) is a
        # start-up error about this model, not a crash.
        raise ConfigError(f"{files[0].parent}: {exc}") from exc
    model.eval().requires_grad_(False)
    pack_linears(model)
    return model


def load_dense_weights(dense: nn.Module, directory: Path, allow_pickle: bool = False) -> None:
    """sentence-transformers Dense: `linear.weight` / `linear.bias` in the module's own folder, under the
    same checkpoint policy as the model."""
    state = dict(iterate_weights(checkpoint_files(directory, allow_pickle)))
    dense.load_state_dict(state)
