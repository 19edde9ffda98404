"""Qwen2-VL's vision tower over a flat batch of patch rows (Qwen2-VL embedders' and ColQwen2's; Qwen2.5-VL's
varies it: qwen2_5_vision.py).

The image processor already cut each image into flattened patches [rows, channels * temporal * patch * patch],
ordered by 2x2 merge blocks; the tower embeds them (its Conv3d, whose kernel is the whole patch, is a matmul
over a row), runs pre-norm blocks whose attention rotates queries and keys by each patch's (row, column) in its
image and attends within one image (the step's vision metadata: one sequence per image), then merges each 2x2
block into one language-model token.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.models.layers import Linear
from embedserv.models.rotary import apply_rotary

# transformers' Qwen2-VL vision LayerNorms.
_EPS = 1e-6


def patch_positions(grids: tuple[tuple[int, ...], ...], merge: int, rows: int) -> np.ndarray:
    """[rows, 2] int64 (row, column) of each patch in its image, images in order, in the processor's merge-block
    order (transformers' get_vision_position_ids); rows past the images' (padding) get (0, 0)."""
    out = np.zeros((rows, 2), dtype=np.int64)
    start = 0
    for t, h, w in grids:
        shape = (h // merge, merge, w // merge, merge)
        hpos = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(shape).transpose(0, 2, 1, 3).ravel()
        wpos = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(shape).transpose(0, 2, 1, 3).ravel()
        count = t * h * w
        out[start : start + count] = np.tile(np.stack((hpos, wpos), axis=1), (t, 1))
        start += count
    return out


class VisionRotary:
    """cos/sin [rows, 1, head_dim // 2]: the first quarter of each head rotates by the patch's row, the second
    by its column (transformers' axial Qwen2VLVisionRotaryEmbedding). Not a module: see rotary.RotaryEmbedding."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.spatial = head_dim // 2
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            exponents = torch.arange(0, self.spatial, 2, dtype=torch.float, device="cpu") / self.spatial
            self._inv_freq = (1.0 / self.theta**exponents).to(positions.device)
        freqs = (positions[..., None].float() * self._inv_freq).flatten(1)
        return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)


class VisionBlock(nn.Module):
    """Pre-norm attention (rotated by each patch's row and column) and MLP. Qwen2.5-VL's blocks
    (qwen2_5_vision.py) change the norms and the MLP; `windowed`: the attention stays within vision windows."""

    def __init__(self, config, layer_index: int, dim: int, windowed: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = dim // self.num_heads
        self.norm1, self.norm2 = self.norm(dim), self.norm(dim)
        self.attn = nn.Module()
        self.attn.qkv = Linear(dim, 3 * dim)
        self.attn.proj = Linear(dim, dim)
        self.attn.attn = Attention(
            self.num_heads, self.head_dim, layer_index=layer_index, kind=AttentionKind.ENCODER, windowed=windowed
        )
        self.mlp = self.build_mlp(config, dim)

    @staticmethod
    def norm(dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=_EPS)

    @staticmethod
    def build_mlp(config, dim: int) -> nn.Module:
        mlp = nn.Module()
        hidden = int(dim * config.mlp_ratio)
        mlp.fc1 = Linear(dim, hidden, activation=config.hidden_act)
        mlp.fc2 = Linear(hidden, dim)
        return mlp

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp.fc2(self.mlp.fc1(x), residual=residual)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.attn.qkv(self.norm1(x)).view(-1, 3 * self.num_heads, self.head_dim)
        qk = apply_rotary(qkv[:, : 2 * self.num_heads], cos, sin)
        q, k = qk[:, : self.num_heads].flatten(1), qk[:, self.num_heads :].flatten(1)
        attended = self.attn.attn(q, k, qkv[:, 2 * self.num_heads :].flatten(1))
        x = self.attn.proj(attended, residual=x)
        return self.feed_forward(self.norm2(x), x)


class PatchMerger(nn.Module):
    """LayerNorm each patch, then one MLP over each merge block's patches side by side -> one LM token."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm=VisionBlock.norm) -> None:
        super().__init__()
        self.block_dim = dim * merge**2
        self.ln_q = norm(dim)
        # Indices as the checkpoint's nn.Sequential (mlp.0, GELU, mlp.2), the GELU fused into the first linear.
        self.mlp = nn.Sequential(
            Linear(self.block_dim, self.block_dim, activation="gelu"), nn.Identity(), Linear(self.block_dim, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.block_dim))


class Qwen2VisionTower(nn.Module):
    """`forward(pixel_values [rows, patch_dim], grids) -> [image tokens, out_dim]`: every image's merged tokens in
    order. Its attention layers take indices from `first_layer_index` on (after the language model's)."""

    block_class = VisionBlock
    # A tower with windowed attention (Qwen2.5-VL's) sets it: models/vision_windows.py.
    vision_windows = None

    def __init__(self, config, first_layer_index: int) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        dim, out_dim = self.widths(config)
        self.patch_embed = nn.Module()
        # The checkpoint's Conv3d weight, used as the matmul it is over a flattened patch.
        self.patch_embed.proj = nn.Module()
        patch = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(dim, *patch))
        self.blocks = nn.ModuleList(
            self.block_class(config, first_layer_index + i, dim, self.is_windowed(config, i))
            for i in range(config.depth)
        )
        self.merger = PatchMerger(out_dim, dim, self.merge, self.block_class.norm)
        self.rotary = VisionRotary(
            dim // config.num_heads, float((config.rope_parameters or {}).get("rope_theta", 10000.0))
        )

    @staticmethod
    def widths(config) -> tuple[int, int]:
        """(the tower's width, the language model's)."""
        return config.embed_dim, config.hidden_size

    @staticmethod
    def is_windowed(config, block: int) -> bool:
        return False

    def forward(self, pixel_values: torch.Tensor, grids: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        hidden = F.linear(pixel_values.to(weight.dtype), weight.flatten(1))
        real_rows = sum(t * h * w for t, h, w in grids)
        # Host integers from the step's grids, one copy each: no device value is read back.
        positions = patch_positions(grids, self.merge, hidden.shape[0])
        order = None
        if self.vision_windows is not None:
            # Rows in window order (the windowed layers' sequences), padding rows last.
            blocks = self.vision_windows.order(grids)
            unit = self.merge**2
            rows = np.concatenate(
                ((blocks[:, None] * unit + np.arange(unit)).ravel(), np.arange(real_rows, len(positions)))
            )
            positions = positions[rows]
            hidden = hidden.index_select(0, torch.from_numpy(rows).to(hidden.device, non_blocking=True))
            order = torch.from_numpy(np.argsort(blocks)).to(hidden.device, non_blocking=True)
        cos, sin = self.rotary(torch.from_numpy(positions).to(hidden.device, non_blocking=True))
        for block in self.blocks:
            hidden = block(hidden, cos, sin)
        merged = self.merger(hidden[:real_rows])
        return merged if order is None else merged.index_select(0, order)
