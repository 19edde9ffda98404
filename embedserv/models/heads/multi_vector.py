"""A MultiVectorEncoder's token head: its Dense layers and Normalize on every token's vector
(loading/multi_vector_files.py reads the settings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embedserv.models.heads.pooling import Dense
from embedserv.models.loading.multi_vector_files import read_multi_vector_settings
from embedserv.models.loading.weights import load_dense_weights


class TokenHead(nn.Module):
    """A MultiVectorEncoder's token modules: [n, hidden] rows -> [n, dim] float32 vectors."""

    def __init__(self, dense: list[Dense], normalize: bool) -> None:
        super().__init__()
        self.dense = nn.ModuleList(dense)
        self.normalize = normalize

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        for layer in self.dense:
            rows = layer(rows.to(layer.linear.weight.dtype))
        rows = rows.float()
        return F.normalize(rows, p=2, dim=-1) if self.normalize else rows


def build_token_head(spec, allow_pickle: bool) -> nn.Module:
    """The token head of a MultiVectorEncoder ModelSpec, on its device and in its dtype."""
    settings = read_multi_vector_settings(spec.model_dir, spec.st, spec.hf_config.hidden_size)
    dense = []
    for dense_spec in settings.dense:
        layer = Dense(dense_spec)
        load_dense_weights(layer, dense_spec.directory, allow_pickle)
        dense.append(layer.to(device=spec.device, dtype=spec.dtype))
    return TokenHead(dense, settings.normalize).eval().requires_grad_(False)
