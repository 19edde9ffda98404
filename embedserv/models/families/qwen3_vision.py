"""Qwen3-VL's vision tower: Qwen2-VL's (qwen2_vision.py: rotary by each patch's row and column, attention within
each image, 2x2 merge blocks) with a biased patch embedding, a learned position table (a square grid of
`num_position_embeddings`, resampled bilinearly, corners aligned, to each image's grid and added to the patch
embeddings), blocks whose MLP is `linear_fc1` -> activation -> `linear_fc2`, and DeepStack: the states after the
blocks in `deepstack_visual_indexes` are merged by mergers of their own (LayerNorm over the merged block) into
language-model-wide features that the language model adds to its image tokens after its first layers
(qwen3_vl.py), as transformers' Qwen3VLVisionModel does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embedserv.models.families.qwen2_vision import Qwen2VisionTower, VisionBlock, patch_positions
from embedserv.models.layers import Linear


def position_taps(grids: tuple[tuple[int, ...], ...], merge: int, side: int, rows: int):
    """([rows, 4] int64 indices into the side x side table, [rows, 4] float32 weights): bilinear with corners
    aligned (transformers' get_vision_interpolation_indices_and_weights), each patch in the processor's merge-block
    order; padding rows get weight 0."""
    positions = patch_positions(grids, merge, rows)
    real = sum(t * h * w for t, h, w in grids)
    sizes = np.ones((rows, 2), dtype=np.float32)
    start = 0
    for t, h, w in grids:
        sizes[start : start + t * h * w] = (h, w)
        start += t * h * w
    # A patch's place in the table per axis: index * (side - 1) / (size - 1), size 1 at 0; in float32 as
    # transformers computes it, so the weights are its bits.
    source = positions.astype(np.float32) * np.float32(side - 1) / np.maximum(sizes - 1, np.float32(1))
    floor = np.floor(source)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor[..., None].astype(np.int64) + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(source[..., None] - floor[..., None] - offsets), 0, None)
    indices = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(rows, 4)
    products = (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(rows, 4)
    products[real:] = 0
    return indices, products


class Qwen3VisionBlock(VisionBlock):
    @staticmethod
    def build_mlp(config, dim: int) -> nn.Module:
        mlp = nn.Module()
        mlp.linear_fc1 = Linear(dim, config.intermediate_size, activation=config.hidden_act)
        mlp.linear_fc2 = Linear(config.intermediate_size, dim)
        return mlp

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp.linear_fc2(self.mlp.linear_fc1(x), residual=residual)


class Qwen3PatchMerger(nn.Module):
    """LayerNorm each patch (or, `after_merge`, the merged block: DeepStack's mergers), then fc1, GELU, fc2 over
    each merge block's patches side by side -> one LM token."""

    def __init__(self, out_dim: int, dim: int, merge: int, after_merge: bool) -> None:
        super().__init__()
        self.block_dim = dim * merge**2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.block_dim if after_merge else dim, eps=1e-6)
        self.linear_fc1 = Linear(self.block_dim, self.block_dim, activation="gelu")
        self.linear_fc2 = Linear(self.block_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.block_dim)) if self.after_merge else self.norm(x).view(-1, self.block_dim)
        return self.linear_fc2(self.linear_fc1(x))


class Qwen3VisionTower(Qwen2VisionTower):
    """`forward(pixel_values, grids) -> ([image tokens, out_dim], DeepStack's features: one such tensor per
    `deepstack_visual_indexes` entry)`."""

    block_class = Qwen3VisionBlock

    def __init__(self, config, first_layer_index: int) -> None:
        super().__init__(config, first_layer_index)
        dim, out_dim = self.widths(config)
        self.patch_embed.proj.bias = nn.Parameter(torch.empty(dim))
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.side = int(config.num_position_embeddings**0.5)
        self.merger = Qwen3PatchMerger(out_dim, dim, self.merge, after_merge=False)
        self.deepstack_visual_indexes = tuple(int(i) for i in config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(out_dim, dim, self.merge, after_merge=True) for _ in self.deepstack_visual_indexes
        )

    @staticmethod
    def widths(config) -> tuple[int, int]:
        return config.hidden_size, config.out_hidden_size

    def forward(self, pixel_values: torch.Tensor, grids: tuple[tuple[int, ...], ...]):
        proj = self.patch_embed.proj
        hidden = F.linear(pixel_values.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
        rows = hidden.shape[0]
        real_rows = sum(t * h * w for t, h, w in grids)
        # Host integers and weights from the step's grids, one copy each: no device value is read back.
        indices, weights = position_taps(grids, self.merge, self.side, rows)
        taps = self.pos_embed(torch.from_numpy(indices).to(hidden.device, non_blocking=True))
        weights_dev = torch.from_numpy(weights).to(hidden.device, non_blocking=True)
        hidden = hidden + (taps * weights_dev[:, :, None].to(taps.dtype)).sum(1).to(hidden.dtype)
        positions = patch_positions(grids, self.merge, rows)
        cos, sin = self.rotary(torch.from_numpy(positions).to(hidden.device, non_blocking=True))
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin)
            if index in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(hidden[:real_rows]))
        return self.merger(hidden[:real_rows]), deepstack
