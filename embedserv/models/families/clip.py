"""CLIP dual encoders (CLIPModel): a text tower and a vision tower whose pooled outputs, projected, share one
embedding space.

The model holds both towers and runs one per pass (a dual encoder, models/interface.py: the runner splits a
mixed step): a text pass over token ids, an image pass over patch rows (a zero row first, where the class
embedding goes).
The text tower is causal (the model's attention is causal, from its config), the vision tower reads the
runner's bidirectional vision metadata. `pool` gives the joint-space vectors: text, the EOS token (the last:
CLIP's tokenizer ends each text with it) -> final_layer_norm -> text_projection; image, the class token ->
post_layernorm -> visual_projection.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.models.layers import Linear
from embedserv.models.loading.family import Family, FamilyDocs, VisionTower
from embedserv.models.vit import DualEncoder, Encoder, PatchEmbedding, TextTower, dual_encoder_checkpoint, num_patches


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = PatchEmbedding(config, bias=False)
        self.position_embedding = nn.Embedding(num_patches(config) + 1, config.hidden_size)

    def forward(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Position 0 of every image is its class token (padding rows too, which nothing reads).
        patches = torch.where((positions == 0)[:, None], self.class_embedding, self.patch_embedding(rows))
        return patches + self.position_embedding(positions)


class ClipVisionTower(nn.Module):
    def __init__(self, config, first_index: int) -> None:
        super().__init__()
        self.embeddings = ClipVisionEmbeddings(config)
        # transformers' spelling.
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = Encoder(config, first_index)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, grids=()) -> torch.Tensor:
        return self.encoder(self.pre_layrnorm(self.embeddings(rows, positions)))


class ClipModel(DualEncoder):
    class_token = True
    # sentence-transformers' CLIPModel module (5.4 on, at the directory's root) is the model's own
    # get_text_features / get_image_features; the older folder layout is read by loading/st_files.model_root.
    st_transformer_modules = ("sentence_transformers.sentence_transformer.modules.clip_model.CLIPModel",)

    def __init__(self, config) -> None:
        super().__init__(config)
        text, vision = config.text_config, config.vision_config
        self.text_model = TextTower(text)
        self.vision_model = ClipVisionTower(vision, first_index=text.num_hidden_layers)
        self.text_projection = Linear(text.hidden_size, config.projection_dim, bias=False)
        self.visual_projection = Linear(vision.hidden_size, config.projection_dim, bias=False)

    def pool(self, hidden: torch.Tensor, pooling, images: bool) -> torch.Tensor:
        """[num_seqs, projection_dim]: each sequence's vector in the joint space (`pooling`: the runner's
        heads/pooling.PoolingInputs, which a family does not import)."""
        if images:
            cls = hidden.index_select(0, pooling.first_index)
            return self.visual_projection(self.vision_model.post_layernorm(cls))
        eos = hidden.index_select(0, pooling.last_index)
        return self.text_projection(self.text_model.final_layer_norm(eos))


def vision_tower(config) -> VisionTower:
    return VisionTower(
        patch_size=config.vision_config.patch_size,
        image_size=config.vision_config.image_size,
        class_token=ClipModel.class_token,
        dimension=config.projection_dim,
        pooling="clip",
    )


FAMILY = Family(
    name="clip",
    model_types=("clip",),
    model_class=ClipModel,
    checkpoint=dual_encoder_checkpoint(r"^(logit_scale$|.*position_ids$)"),
    # Its text tower is causal (the config's default); the vision tower is bidirectional all the same.
    is_encoder=False,
    vision=vision_tower,
)

DOCS = FamilyDocs(
    examples=(
        "openai/clip-vit-base-patch32",
        "openai/clip-vit-large-patch14",
        "laion/CLIP-ViT-B-32-laion2B-s34B-b79K",
        "sentence-transformers/clip-ViT-B-32",
    ),
    tested_by=("tests/models/test_clip_parity.py",),
)
