"""Qwen2.5-VL's vision tower: Qwen2-VL's (qwen2_vision.py) with RMSNorm in place of LayerNorm (the blocks' and
the merger's), a gated SiLU MLP with biases, and windowed attention: every block but those in
`fullatt_block_indexes` attends within windows of `window_size` pixels (models/vision_windows.py), the rest
within each image's frame. The tower runs its rows in window order (each window contiguous) and puts the merged
tokens back in the processor's order, as transformers' Qwen2_5_VisionTransformerPretrainedModel does.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.models.families.llama import RMSNorm
from embedserv.models.families.qwen2_vision import Qwen2VisionTower, VisionBlock
from embedserv.models.layers import Linear, get_activation, packed_linear
from embedserv.models.vision_windows import VisionWindows

# transformers' Qwen2.5-VL vision RMSNorms.
_EPS = 1e-6


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), each with a bias; gate and up in one matmul (the loader stacks them)."""

    def __init__(self, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.gate_up = packed_linear(dim, (hidden, hidden), bias=True)
        self.down_proj = Linear(hidden, dim)
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, residual=residual)


class Qwen25VisionBlock(VisionBlock):
    @staticmethod
    def norm(dim: int) -> nn.Module:
        return RMSNorm(dim, _EPS)

    @staticmethod
    def build_mlp(config, dim: int) -> nn.Module:
        return GatedMLP(dim, config.intermediate_size, config.hidden_act)

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp(x, residual)


class Qwen25VisionTower(Qwen2VisionTower):
    block_class = Qwen25VisionBlock

    def __init__(self, config, first_layer_index: int) -> None:
        super().__init__(config, first_layer_index)
        self.vision_windows = VisionWindows(
            int(config.window_size), int(config.patch_size), int(config.spatial_merge_size)
        )

    @staticmethod
    def widths(config) -> tuple[int, int]:
        return config.hidden_size, config.out_hidden_size

    @staticmethod
    def is_windowed(config, block: int) -> bool:
        return block not in set(config.fullatt_block_indexes or ())
