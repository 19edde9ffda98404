"""SigLIP 2 with NaFlex variable resolution (Siglip2Model): SigLIP's towers and heads (siglip.py), with images
kept near their aspect ratio at up to the processor's max_num_patches patches (engine/inputs/images: rows in
(row, column, channel) order, the grid (rows, columns)). Its patch embedding is a linear layer, and its
position embeddings, a square table, are resized per image to the image's grid (bilinear, antialiased) as
transformers resizes them. Each image is its own sequence: no padding patches, so no attention mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embedserv.models.families.siglip import SiglipModel
from embedserv.models.layers import Linear
from embedserv.models.loading.family import Family, FamilyDocs, VisionTower
from embedserv.models.vit import dual_encoder_checkpoint


class ResizedPositionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.side = int(config.num_patches**0.5)
        if self.side * self.side != config.num_patches:
            raise ValueError(f"num_patches {config.num_patches} is not a square number of position embeddings")
        hidden = config.hidden_size
        self.patch_embedding = Linear(config.num_channels * config.patch_size**2, hidden)
        self.position_embedding = nn.Embedding(config.num_patches, hidden)

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, grids) -> torch.Tensor:
        table = self.position_embedding.weight.reshape(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        resized = [
            F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
            .reshape(table.shape[1], h * w)
            .T
            for h, w in grids
        ]
        patches = self.patch_embedding(rows.to(self.patch_embedding.weight.dtype))
        added = torch.cat(resized).to(patches.dtype)
        # Padding rows (models/layers.py) after the images' rows get none.
        return torch.cat((patches[: len(added)] + added, patches[len(added) :]))


class Siglip2Model(SiglipModel):
    def __init__(self, config) -> None:
        super().__init__(config, vision_embeddings=ResizedPositionEmbeddings(config.vision_config))

    @property
    def image_shape(self) -> tuple[int, int, tuple[int, int]]:
        side = self.vision_model.embeddings.side
        return side * side, self.vision_model.embeddings.patch_embedding.in_features, (side, side)


def vision_tower(config) -> VisionTower:
    return VisionTower(
        patch_size=config.vision_config.patch_size,
        image_size=0,
        class_token=False,
        dimension=config.vision_config.hidden_size,
        pooling="siglip",
        pads_texts=True,
        text_pad_id=int(config.text_config.pad_token_id or 0),
        layout="siglip2",
    )


FAMILY = Family(
    name="siglip2",
    model_types=("siglip2",),
    model_class=Siglip2Model,
    checkpoint=dual_encoder_checkpoint(r"^(logit_scale$|logit_bias$|.*position_ids$)"),
    is_encoder=True,
    vision=vision_tower,
)

DOCS = FamilyDocs(
    examples=("google/siglip2-base-patch16-naflex", "google/siglip2-so400m-patch16-naflex"),
    tested_by=("tests/models/test_siglip2_parity.py",),
)
