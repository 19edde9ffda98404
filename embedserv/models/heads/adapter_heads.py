"""Classifier heads of --lora adapters (PEFT's modules_to_save, which task_type SEQ_CLS fills with the
classifier): each such adapter scores its rows with its own copy of the model's ScoreHead, the copy's
tensors replaced by the adapter's, found under the family's Classifier names as the base head's are."""

from __future__ import annotations

import copy

import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.heads.pooling import PoolingInputs
from embedserv.models.heads.score import ScoreHead
from embedserv.models.loading.family import Classifier


class AdapterScoreHeads(nn.Module):
    """The base head for rows of the base and of adapters without a head of their own; each other adapter's
    head for its rows. Every head runs over the step's rows (one row per sequence: cheap next to the model),
    and each row keeps its own adapter's."""

    def __init__(self, base: ScoreHead, heads: dict[int, ScoreHead]) -> None:
        super().__init__()
        self.base = base
        self.adapters = tuple(heads)
        self.heads = nn.ModuleList(heads.values())

    def forward(self, hidden: torch.Tensor, pooling: PoolingInputs, row_adapters: tuple[int, ...]) -> torch.Tensor:
        out = self.base(hidden, pooling)
        for adapter, head in zip(self.adapters, self.heads, strict=True):
            chosen = [row for row, row_adapter in enumerate(row_adapters) if row_adapter == adapter]
            if chosen:
                index = torch.tensor(chosen, device=out.device)
                out[index] = head(hidden, pooling).index_select(0, index)
        return out


def adapter_head(base: ScoreHead, classifier: Classifier, tensors: dict[str, torch.Tensor], adapter: str) -> ScoreHead:
    """A copy of `base` with the adapter's saved head tensors (checkpoint names, `classifier.weight`...)."""
    head = copy.deepcopy(base)
    used = set()
    for ours, param in head.named_parameters():
        name = next((n for n in classifier.sources.get(ours, ()) if n in tensors), None)
        if name is None:
            continue
        if tensors[name].shape != param.shape:
            raise ConfigError(
                f"--lora {adapter}: its head tensor {name} has shape {tuple(tensors[name].shape)}, the model's "
                f"{tuple(param.shape)}"
            )
        param.data.copy_(tensors[name])
        used.add(name)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ConfigError(f"--lora {adapter}: saved modules the model's classifier head has no place for: {unused}")
    return head
