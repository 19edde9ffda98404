"""The transformer blocks CLIP and SigLIP share (families/clip.py, families/siglip.py): pre-norm encoder
layers over a flat packed batch, the token and position embeddings of their text towers, and the patch
embedding of their vision towers, which runs on an image's patch rows (steps.ScheduledSequence.pixels).

Parameter names follow transformers' CLIPModel / SiglipModel (`text_model.encoder.layers.N.self_attn...`),
so their checkpoints load with q/k/v packed and nothing else renamed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.models.interface import DualEncoderModel
from embedserv.models.layers import Linear, packed_linear
from embedserv.models.loading.family import QKV, CheckpointNames


class SelfAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.hidden_size = hidden
        self.qkv = packed_linear(hidden, (hidden,) * 3)
        # Encoder kind: the text pass reads the step's metadata (causal for CLIP's text tower, as its
        # config makes the model), the image pass the vision tower's bidirectional metadata.
        self.attn = Attention(num_heads, hidden // num_heads, layer_index=layer_index, kind=AttentionKind.ENCODER)
        self.out_proj = Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden).split(self.hidden_size, dim=-1)
        return self.out_proj(self.attn(q, k, v), residual=residual)


class Mlp(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, activation=config.hidden_act)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc2(self.fc1(hidden), residual=residual)


class EncoderLayer(nn.Module):
    """LayerNorm, attention, residual; LayerNorm, MLP, residual."""

    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config, layer_index)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.self_attn(self.layer_norm1(hidden), residual=hidden)
        return self.mlp(self.layer_norm2(hidden), residual=hidden)


class Encoder(nn.Module):
    """A tower's layers; `first_index`: the layer_index of its first (the two towers' layers differ)."""

    def __init__(self, config, first_index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config, first_index + i) for i in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class TextEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class TextTower(nn.Module):
    """Token and position embeddings, the layers, and the final norm `pool` applies (to the pooled rows only);
    SigLIP's adds a `head` (a linear of `head_size` outputs) after that norm."""

    def __init__(self, config, head_size: int | None = None) -> None:
        super().__init__()
        self.embeddings = TextEmbeddings(config)
        self.encoder = Encoder(config, first_index=0)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if head_size is not None:
            self.head = Linear(config.hidden_size, head_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions))


class DualEncoder(nn.Module, DualEncoderModel):
    """What CLIP's and SigLIP's models share: `forward(input_ids, positions, pixel_values=None,
    image_grids=())` -> [num_tokens, hidden] of the text tower (`text_model`), or of the vision tower
    (`vision_model(rows, positions, image_grids)`, the grids in packed order) when pixel_values (patch rows)
    are given. Subclasses build the towers and `pool`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @property
    def max_positions(self) -> int:
        return self.config.text_config.max_position_embeddings

    @property
    def image_shape(self) -> tuple[int, int, tuple[int, int]]:
        """(rows, values per row, grid) of a full-size image's sequence: the runner's warm-up makes such images."""
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        return side * side + int(self.class_token), self.vision_model.embeddings.patch_embedding.patch_dim, (side, side)

    def forward(self, input_ids, positions, pixel_values=None, image_grids=()) -> torch.Tensor:
        if pixel_values is None:
            return self.text_model(input_ids, positions)
        return self.vision_model(pixel_values, positions, image_grids)


class PatchEmbedding(nn.Module):
    """The checkpoint's stride-P convolution as a linear map of patch rows: its weight [hidden, C, P, P]
    flattened in (channel, row, column) order is the order of the rows' values."""

    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        size = config.patch_size
        self.weight = nn.Parameter(torch.empty(config.hidden_size, config.num_channels, size, size))
        self.bias = nn.Parameter(torch.empty(config.hidden_size)) if bias else None

    @property
    def patch_dim(self) -> int:
        return self.weight[0].numel()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows.to(self.weight.dtype), self.weight.reshape(self.weight.shape[0], -1), self.bias)


def num_patches(vision_config) -> int:
    return (vision_config.image_size // vision_config.patch_size) ** 2


def dual_encoder_checkpoint(ignored: str) -> CheckpointNames:
    """CLIPModel / SiglipModel names, bare or under sentence-transformers' `model.`; `ignored`: the
    contrastive loss's parameters and buffers, which embeddings do not use."""
    return CheckpointNames(prefixes=("model.",), ignored=ignored, packed=QKV)
