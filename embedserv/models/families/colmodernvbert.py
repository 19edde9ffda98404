"""ColModernVBERT (transformers' ColModernVBertForRetrieval): a ModernVBERT model whose last hidden states, projected
and L2-normalized (models/heads/vision_retrieval.py), are one vector per token of a query or a page image.

ModernVBERT, as transformers' ModernVBertModel runs it:
- the vision tower is SigLIP's without its pooling head (siglip.SiglipVisionStates), run on every frame of a page
  alone: the processor cuts a page into tiles of the tower's image_size and adds the whole page at that size
  (engine/inputs/images/idefics3.py); the frames' grid is (frames, side, side), which the step's vision metadata
  splits into one sequence per frame (worker/image_inputs.py);
- the connector (Idefics3's): each frame's side x side states pixel-shuffled by pixel_shuffle_factor f into
  (side / f)^2 rows of f^2 states side by side, then a linear projection (no bias) to the text width;
- those rows take the places of the `<image>` placeholders, frame after frame in the processor's order (the
  engine's rules frame them: engine/inputs/colmodernvbert_rules.py), among the token embeddings, before
  ModernBERT's embedding norm (transformers normalizes inputs_embeds there too);
- the text encoder is ModernBERT (families/modernbert.py): bidirectional, with its local-window layers.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.models.families.modernbert import ModernBertModel
from embedserv.models.families.siglip import SiglipVisionStates
from embedserv.models.interface import EncoderModel
from embedserv.models.loading.family import QKV, CheckpointNames, Family, FamilyDocs


def language_config(config):
    return config.vlm_config.text_config


class Connector(nn.Module):
    """transformers' ModernVBertConnector: pixel shuffle, then `modality_projection`."""

    def __init__(self, vlm_config) -> None:
        super().__init__()
        vision = vlm_config.vision_config
        self.factor = int(vlm_config.pixel_shuffle_factor)
        # engine/inputs/colmodernvbert_rules.py refuses at start-up a side the factor does not divide.
        self.side = vision.image_size // vision.patch_size
        width = vision.hidden_size * self.factor**2
        self.modality_projection = nn.Linear(width, vlm_config.text_config.hidden_size, bias=False)

    def forward(self, states: torch.Tensor, frames: int) -> torch.Tensor:
        """[frames * side^2 (+ padding rows), D] -> [frames * (side / f)^2, text hidden], frame after frame."""
        side, f = self.side, self.factor
        dim = states.shape[-1]
        x = states[: frames * side * side].reshape(frames, side, side // f, dim * f)
        x = x.permute(0, 2, 1, 3).reshape(frames, side // f, side // f, dim * f * f)
        x = x.permute(0, 2, 1, 3).reshape(frames * (side // f) ** 2, dim * f * f)
        return self.modality_projection(x)


class ColModernVBertModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions, pixel_values=None, image_grids=()) -> [num_tokens, hidden]`: every page's
    frames' features at its placeholder tokens, pages in packed order (`image_grids`: (frames, side, side) each)."""

    takes_images = True
    text_config = staticmethod(language_config)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vlm = config.vlm_config
        text = vlm.text_config
        self.image_token_id = int(vlm.image_token_id)
        self.text_model = ModernBertModel(text)
        self.vision_model = SiglipVisionStates(vlm.vision_config, first_layer_index=text.num_hidden_layers)
        self.connector = Connector(vlm)

    @property
    def max_positions(self) -> int:
        return self.text_model.max_positions

    def forward(self, input_ids, positions, pixel_values=None, image_grids=()) -> torch.Tensor:
        embeddings = self.text_model.embeddings
        hidden = embeddings.tok_embeddings(input_ids)
        if pixel_values is not None:
            # Host integers from the step's grids: no device value is read back.
            frames = sum(grid[0] for grid in image_grids)
            states = self.vision_model(pixel_values.to(hidden.dtype))
            features = self.connector(states, frames).to(hidden.dtype)
            hidden = hidden.masked_scatter((input_ids == self.image_token_id).unsqueeze(-1), features)
        return self.text_model.run_layers(embeddings.norm(hidden), positions)


CHECKPOINT = CheckpointNames(
    prefixes=("vlm.",),
    # The projection is the token head's (models/heads/vision_retrieval.py); a SigLIP pooling head, where a
    # checkpoint keeps one, is not used (transformers reads last_hidden_state).
    ignored=r"^(embedding_proj_layer\.|vision_model\.head\.|.*position_ids$)",
    packed=QKV,
)

FAMILY = Family(
    name="colmodernvbert",
    model_types=("colmodernvbert",),
    model_class=ColModernVBertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
)

DOCS = FamilyDocs(
    examples=("ModernVBERT/colmodernvbert-merged",),
    tested_by=("tests/models/test_colmodernvbert_parity.py", "tests/models/test_vision_retrieval_engine.py"),
)
