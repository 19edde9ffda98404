"""ColQwen2 (transformers' ColQwen2ForRetrieval): a Qwen2-VL model whose last hidden states, projected and
L2-normalized (models/heads/vision_retrieval.py), are one vector per token of a query or a page image.

A page image runs through the vision tower (qwen2_vision.py) and its merged tokens take the places of the
`<|image_pad|>` placeholders in the language model's input (the engine's rules expand them to the image's
token count); queries are text alone. The language model is the Qwen2 decoder (llama.py), causal.

Positions: transformers' ColQwen2ForRetrieval calls its Qwen2-VL model with input embeddings and no ids or
grids, so Qwen2-VL computes no 3D (M-RoPE) positions: every token, image ones included, rotates by its plain
index in its sequence, in all three M-RoPE sections alike, which is ordinary RoPE. We do as it does.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from embedserv.models.families.llama import LlamaStack
from embedserv.models.families.qwen2_vision import Qwen2VisionTower
from embedserv.models.interface import DecoderModel
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs


def text_config(config):
    """The language model's config, read as Qwen2's (q/k/v biases, no output bias: llama._biases)."""
    text = copy.copy(config.vlm_config.get_text_config())
    text.model_type = "qwen2"
    return text


class ColQwen2Model(nn.Module, DecoderModel):
    """`forward(input_ids, positions, pixel_values=None, image_grids=()) -> [num_tokens, hidden]`: image
    features at the placeholder tokens, in the order of `image_grids` (the packed order)."""

    takes_images = True
    text_config = staticmethod(text_config)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vlm = config.vlm_config
        self.image_token_id = int(vlm.image_token_id)
        self.language_model = LlamaStack(text_config(config))
        self.visual = Qwen2VisionTower(vlm.vision_config, first_layer_index=len(self.language_model.layers))

    @property
    def max_positions(self) -> int:
        return self.language_model.max_positions

    def forward(self, input_ids, positions, pixel_values=None, image_grids=()) -> torch.Tensor:
        hidden = self.language_model.embed_tokens(input_ids)
        if pixel_values is not None:
            features = self.visual(pixel_values, tuple(image_grids)).to(hidden.dtype)
            hidden = hidden.masked_scatter((input_ids == self.image_token_id).unsqueeze(-1), features)
        return self.language_model.run_layers(hidden, positions)


CHECKPOINT = CheckpointNames(
    # transformers 5 saves `vlm.visual.` and `vlm.language_model.`; checkpoints saved before it (the hub's) nest
    # both under `vlm.model.` beside an unused `vlm.lm_head`.
    prefixes=("vlm.model.", "vlm."),
    # The projection is the token head's (models/heads/vision_retrieval.py).
    ignored=r"^(embedding_proj_layer\.|lm_head\.|language_model\.rotary_emb\.)",
    packed=QKV_GATE_UP,
)

FAMILY = Family(
    name="colqwen2",
    model_types=("colqwen2",),
    model_class=ColQwen2Model,
    checkpoint=CHECKPOINT,
    is_encoder=False,
)

DOCS = FamilyDocs(
    examples=("vidore/colqwen2-v1.0-hf",),
    tested_by=("tests/models/test_colqwen2_parity.py", "tests/models/test_vision_retrieval_engine.py"),
)
