"""SigLIP dual encoders (SiglipModel; SigLIP 2's fixed-resolution checkpoints are SiglipModels too): a text
tower and a vision tower sharing one embedding space, on the blocks CLIP has (models/vit.py).

As CLIP's (clip.py), the model runs one tower per pass. Both towers are bidirectional. Texts come padded to
the model's input limit (the processor's padding="max_length"; the engine pads them, VisionTower.pads_texts)
and the text tower reads the last position -> final_layer_norm -> head. Images have no class token: every
patch row -> post_layernorm -> the attention pooling head (one learned probe query over the image's rows,
then a LayerNorm and MLP with a residual).
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.models.layers import Linear
from embedserv.models.loading.family import Family, FamilyDocs, VisionTower
from embedserv.models.vit import (
    DualEncoder,
    Encoder,
    Mlp,
    PatchEmbedding,
    TextTower,
    dual_encoder_checkpoint,
    num_patches,
)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_embedding = PatchEmbedding(config, bias=True)
        self.position_embedding = nn.Embedding(num_patches(config), config.hidden_size)

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, grids=()) -> torch.Tensor:
        return self.patch_embedding(rows) + self.position_embedding(positions)


class SiglipVisionStates(nn.Module):
    """SigLIP's embeddings, encoder and post-layernorm, without the pooling head (PaliGemma's and ModernVBERT's
    towers): [rows, patch_dim] -> [rows, vision hidden], every image (or tile) image_size squared."""

    def __init__(self, config, first_layer_index: int) -> None:
        super().__init__()
        self.num_patches = num_patches(config)
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = Encoder(config, first_layer_index)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # Every image has num_patches rows, in order; padding rows after them take any position.
        positions = torch.arange(rows.shape[0], device=rows.device) % self.num_patches
        return self.post_layernorm(self.encoder(self.embeddings(rows, positions)))


class ProbeAttention(nn.Module):
    """torch's MultiheadAttention for one query per sequence, over each sequence's own rows (flat varlen)."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden))
        self.out_proj = Linear(hidden, hidden)

    def forward(self, probe: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """probe [hidden], rows [n, hidden], seq [n] (each row's sequence) -> [num_seqs, hidden]."""
        hidden = probe.shape[-1]
        heads, size = self.num_heads, hidden // self.num_heads
        w, b = self.in_proj_weight, self.in_proj_bias
        q = (probe @ w[:hidden].T + b[:hidden]).view(heads, size)
        k = (rows @ w[hidden : 2 * hidden].T + b[hidden : 2 * hidden]).view(-1, heads, size)
        v = (rows @ w[2 * hidden :].T + b[2 * hidden :]).view(-1, heads, size)
        scores = (k * q).sum(-1).float() * size**-0.5
        # A softmax per sequence: subtract each sequence's largest score, then normalize by its sum.
        index = seq[:, None].expand_as(scores)
        top = scores.new_full((num_seqs, heads), float("-inf")).scatter_reduce_(0, index, scores, reduce="amax")
        weights = (scores - top.index_select(0, seq)).exp()
        sums = weights.new_zeros(num_seqs, heads).index_add_(0, seq, weights)
        weights = (weights / sums.index_select(0, seq)).to(v.dtype)
        pooled = v.new_zeros(num_seqs, heads, size).index_add_(0, seq, v * weights[..., None])
        return self.out_proj(pooled.reshape(num_seqs, hidden))


class PoolingHead(nn.Module):
    """transformers' SiglipMultiheadAttentionPoolingHead."""

    def __init__(self, config) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, config.hidden_size))
        self.attention = ProbeAttention(config.hidden_size, config.num_attention_heads)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)

    def forward(self, rows: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
        pooled = self.attention(self.probe.reshape(-1), rows, seq, num_seqs)
        return self.mlp(self.layernorm(pooled), residual=pooled)


class SiglipVisionTower(nn.Module):
    """`embeddings(rows, positions, grids)`: SigLIP's, or SigLIP 2's resizable ones (siglip2.py)."""

    def __init__(self, config, first_index: int, embeddings: nn.Module | None = None) -> None:
        super().__init__()
        if not getattr(config, "vision_use_head", True):
            raise ValueError("a SigLIP vision tower without its pooling head (vision_use_head false) embeds no image")
        self.embeddings = embeddings if embeddings is not None else SiglipVisionEmbeddings(config)
        self.encoder = Encoder(config, first_index)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.head = PoolingHead(config)

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, grids=()) -> torch.Tensor:
        return self.encoder(self.embeddings(rows, positions, grids))


class SiglipModel(DualEncoder):
    def __init__(self, config, vision_embeddings: nn.Module | None = None) -> None:
        super().__init__(config)
        text, vision = config.text_config, config.vision_config
        if text.projection_size != vision.hidden_size:
            raise ValueError(
                f"text projection_size {text.projection_size} differs from the vision width {vision.hidden_size}"
            )
        self.text_model = TextTower(text, head_size=text.projection_size)
        self.vision_model = SiglipVisionTower(vision, text.num_hidden_layers, vision_embeddings)

    def pool(self, hidden: torch.Tensor, pooling, images: bool) -> torch.Tensor:
        """[num_seqs, dim]: each sequence's vector in the joint space (`pooling`: the runner's
        heads/pooling.PoolingInputs, which a family does not import)."""
        num_seqs = pooling.first_index.shape[0]
        if images:
            # Every row of an image counts (no prompt): the rows the pooling covers, in token_seq order.
            rows = hidden if pooling.token_index is None else hidden.index_select(0, pooling.token_index)
            rows = self.vision_model.post_layernorm(rows)
            return self.vision_model.head(rows, pooling.token_seq, num_seqs)
        last = hidden.index_select(0, pooling.last_index)
        return self.text_model.head(self.text_model.final_layer_norm(last))


def vision_tower(config) -> VisionTower:
    return VisionTower(
        patch_size=config.vision_config.patch_size,
        image_size=config.vision_config.image_size,
        class_token=False,
        dimension=config.vision_config.hidden_size,
        pooling="siglip",
        pads_texts=True,
        text_pad_id=int(config.text_config.pad_token_id or 0),
    )


FAMILY = Family(
    name="siglip",
    model_types=("siglip",),
    model_class=SiglipModel,
    checkpoint=dual_encoder_checkpoint(r"^(logit_scale$|logit_bias$|.*position_ids$)"),
    is_encoder=True,
    vision=vision_tower,
)

DOCS = FamilyDocs(
    # SigLIP (v1) checkpoints ship a SentencePiece tokenizer with Python-side text canonicalization and no
    # tokenizer.json: refused at start-up, as every tokenizer without one is. SigLIP 2's fixed-resolution
    # checkpoints (Gemma's tokenizer.json) are SiglipModels.
    examples=(
        "google/siglip2-base-patch16-224",
        "google/siglip2-so400m-patch14-384",
        "google/siglip2-large-patch16-256",
    ),
    tested_by=("tests/models/test_siglip_parity.py",),
)
