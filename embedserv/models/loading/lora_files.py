"""PEFT LoRA adapter directories served with --lora NAME=PATH: read and checked at start-up, then attached.

The engine reads each adapter_config.json with the model's spec (`read_lora_adapters`: refusals stop
start-up before a worker loads anything); each worker reads adapter_model.safetensors and wraps the
targeted Linears (`attach_lora`). A PEFT key `base_model.model.<HF module path>.lora_A.weight` goes
through the family's own checkpoint names (loading/family.py) as `<path>.weight` would, so whatever the
loader maps (prefixes, renames, q/k/v packed into one qkv) adapters follow. A packed linear's shards
stack their A's ([r_q + r_k + r_v, in]) and place their B's block-diagonally: exactly the separate
updates. Each adapter's scaling (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into its B; ranks
differ per adapter and module, so each module pads to its largest with zeros.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.layers import Linear
from embedserv.models.loading.weights import compiled_names
from embedserv.models.lora import LoraLinear, LowRank

# The largest rank served: past it the two low-rank matmuls stop being thin next to the linear.
MAX_LORA_RANK = 64
_WEIGHTS = "adapter_model.safetensors"
# modules_to_save PEFT's task_type SEQ_CLS names: the classifier head, served per adapter.
_HEAD_MODULES = ("classifier", "score")
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as adapter_config.json describes it (weights read by attach_lora)."""

    name: str
    path: Path
    lora_alpha: float
    use_rslora: bool
    # PEFT's modules_to_save served per adapter: the classifier head of task_type SEQ_CLS (heads/adapter_heads.py).
    saves_modules: tuple[str, ...] = ()

    def scaling(self, rank: int) -> float:
        """PEFT's scaling for a module of this rank (rank_pattern may give a module its own)."""
        return self.lora_alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _refuse(name: str, path: Path, why: str) -> ConfigError:
    return ConfigError(f"--lora {name}={path}: {why}")


def _weights_file(name: str, path: Path) -> Path:
    weights = path / _WEIGHTS
    if weights.is_file():
        return weights
    if (path / "adapter_model.bin").is_file():
        raise _refuse(
            name,
            path,
            (
                "has only adapter_model.bin (a pickle, which can run code when loaded); adapters are read from "
                "adapter_model.safetensors: save it with PEFT's save_pretrained(..., safe_serialization=True)"
            ),
        )
    raise _refuse(name, path, f"no {_WEIGHTS} there; give a PEFT adapter directory (save_pretrained's output)")


def _check_config(name: str, path: Path, raw: dict) -> None:
    """Refuses what this server does not apply as PEFT would."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, path, f"peft_type {raw.get('peft_type')!r}; only LORA adapters are served")
    refusals = (
        (
            "use_dora",
            "is a DoRA adapter (use_dora), whose magnitude vectors are not applied here; merge it "
            "into the model and serve that instead",
        ),
        ("fan_in_fan_out", "sets fan_in_fan_out (transposed Conv1D weights), which encoder linears do not have"),
        (
            "alpha_pattern",
            "sets alpha_pattern (per-module alphas), which is not applied here; train with one lora_alpha",
        ),
        ("target_parameters", "targets parameters directly (target_parameters), which is not applied here"),
        ("trainable_token_indices", "trains token embeddings (trainable_token_indices), which is not applied here"),
        ("lora_bias", "trains a bias for its B matrices (lora_bias), which is not applied here"),
    )
    for key, why in refusals:
        value = raw.get(key)
        if value:
            raise _refuse(name, path, why.format(value=value))
    others = [module for module in raw.get("modules_to_save") or () if module not in _HEAD_MODULES]
    if others:
        raise _refuse(
            name,
            path,
            (
                f"saves whole modules beside its LoRA weights (modules_to_save: {', '.join(others)}); only the "
                f"classifier head ({' / '.join(_HEAD_MODULES)}, as task_type SEQ_CLS saves it) is served per adapter"
            ),
        )
    if raw.get("bias", "none") != "none":
        raise _refuse(name, path, f"trains biases (bias {raw['bias']!r}); only bias 'none' is served")
    ranks = [raw.get("r", 8), *(raw.get("rank_pattern") or {}).values()]
    if max(ranks) > MAX_LORA_RANK:
        raise _refuse(name, path, f"rank {max(ranks)} is more than the {MAX_LORA_RANK} served; train a smaller rank")


def read_lora_adapter(name: str, path_text: str) -> LoraAdapter:
    path = Path(path_text).expanduser()
    config_file = path / "adapter_config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(name, path, f"cannot read {config_file.name} ({exc}); give a PEFT adapter directory") from None
    if not isinstance(raw, dict):
        raise _refuse(name, path, f"{config_file.name} is not a JSON object")
    _check_config(name, path, raw)
    _weights_file(name, path)
    saves = tuple(raw.get("modules_to_save") or ())
    return LoraAdapter(name, path, float(raw.get("lora_alpha", 8)), bool(raw.get("use_rslora", False)), saves)


def read_lora_adapters(lora: tuple[tuple[str, str], ...]) -> tuple[LoraAdapter, ...]:
    return tuple(read_lora_adapter(name, path) for name, path in lora)


# A module of ours -> adapter index -> shard -> (A [r, in], B [shard rows, r] times the scaling).
_Updates = dict[str, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]


def _target(model: nn.Module, names, adapter: LoraAdapter, hf_path: str) -> tuple[str, int, Linear]:
    """Our Linear for a PEFT target path, and its shard (0 for an unpacked linear)."""
    ours, shard = names.ours(f"{hf_path}.weight")
    where = f"target {hf_path!r}"
    if ours is None:
        raise _refuse(adapter.name, adapter.path, f"{where} is in a head or pooler, which adapters do not change here")
    module_name = ours.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name) if ours.endswith(".weight") else None
    except AttributeError:
        module = None
    if isinstance(module, nn.Embedding):
        raise _refuse(adapter.name, adapter.path, f"{where} is an embedding table; embedding LoRA is not served")
    if not isinstance(module, Linear):
        why = f"{where}: the model has no linear layer there (its name here: {ours!r})"
        raise _refuse(adapter.name, adapter.path, why)
    return module_name, shard or 0, module


def _read_updates(
    model: nn.Module, names, index: int, adapter: LoraAdapter, updates: _Updates, heads: dict[str, torch.Tensor]
) -> None:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter.path / _WEIGHTS), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = _KEY.match(key)
            saved = key.removeprefix("base_model.model.")
            if match is None and saved.split(".")[0] in adapter.saves_modules:
                heads[saved] = f.get_tensor(key)
                continue
            if match is None:
                what = (
                    "DoRA magnitude"
                    if "lora_magnitude_vector" in key
                    else "embedding LoRA"
                    if ("lora_embedding_" in key)
                    else "a tensor that is not a LoRA A/B weight"
                )
                raise _refuse(adapter.name, adapter.path, f"{key!r} is {what}, which is not served")
            parts.setdefault(match["path"], {})[match["part"]] = f.get_tensor(key).float()
    for hf_path, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(adapter.name, adapter.path, f"target {hf_path!r} has lora_{''.join(pair)} alone")
        module_name, shard, linear = _target(model, names, adapter, hf_path)
        a, b = pair["A"], pair["B"]
        sizes = linear.shard_sizes or (linear.out_features,)
        rank = a.shape[0]
        if a.shape != (rank, linear.in_features) or b.shape != (sizes[shard], rank):
            raise _refuse(
                adapter.name,
                adapter.path,
                (
                    f"target {hf_path!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; the model's layer takes "
                    f"A [r, {linear.in_features}] and B [{sizes[shard]}, r]: an adapter of another model?"
                ),
            )
        if rank > MAX_LORA_RANK:
            raise _refuse(adapter.name, adapter.path, f"target {hf_path!r} has rank {rank}, more than {MAX_LORA_RANK}")
        updates.setdefault(module_name, {}).setdefault(index, {})[shard] = (a, b * adapter.scaling(rank))


def _stacked(linear: Linear, per_adapter: dict[int, dict[int, tuple]], num_adapters: int) -> LowRank:
    """One LowRank over every adapter. Each shard of a packed linear takes a fixed slot of the rank, as wide as
    its largest rank over the adapters (smaller ones padded with zeros): A's stacked, B's block-diagonal."""
    sizes = linear.shard_sizes or (linear.out_features,)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    widths = [
        max((shards[s][0].shape[0] for shards in per_adapter.values() if s in shards), default=0)
        for s in range(len(sizes))
    ]
    offsets = [sum(widths[:s]) for s in range(len(sizes))]
    low_rank = LowRank(linear.in_features, linear.out_features, num_adapters, sum(widths), 1.0)
    lora_a = torch.zeros(num_adapters, sum(widths), linear.in_features)
    lora_b = torch.zeros(num_adapters, linear.out_features, sum(widths))
    for index, shards in per_adapter.items():
        for shard, (a, b) in shards.items():
            ranks = slice(offsets[shard], offsets[shard] + a.shape[0])
            lora_a[index, ranks] = a
            lora_b[index, starts[shard] : starts[shard] + sizes[shard], ranks] = b
    low_rank.lora_A = nn.Parameter(lora_a, requires_grad=False)
    low_rank.lora_B = nn.Parameter(lora_b, requires_grad=False)
    if len(sizes) > 1:
        low_rank.blocks = tuple(
            (starts[s], starts[s] + sizes[s], offsets[s], offsets[s] + widths[s])
            for s in range(len(sizes))
            if widths[s]
        )
    return low_rank


def attach_lora(
    model: nn.Module, family, adapters: tuple[LoraAdapter, ...], dtype: torch.dtype
) -> tuple[int, dict[int, dict[str, torch.Tensor]]]:
    """Wraps every Linear some adapter targets in a LoraLinear (adapter i: index i); returns how many, and the
    classifier heads adapters save (modules_to_save) by adapter index: checkpoint name -> tensor."""
    names = compiled_names(family, model.config)
    updates: _Updates = {}
    heads: dict[int, dict[str, torch.Tensor]] = {}
    for index, adapter in enumerate(adapters):
        _read_updates(model, names, index, adapter, updates, heads.setdefault(index, {}))
    device = next(model.parameters()).device
    for module_name, per_adapter in updates.items():
        linear = model.get_submodule(module_name)
        low_rank = _stacked(linear, per_adapter, len(adapters)).to(device=device, dtype=dtype)
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(linear, low_rank))
    return len(updates), {index: tensors for index, tensors in heads.items() if tensors}
