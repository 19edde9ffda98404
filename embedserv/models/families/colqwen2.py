"""ColQwen2 (transformers' ColQwen2ForRetrieval): a Qwen2-VL model whose last hidden states, projected and
L2-normalized (models/heads/vision_retrieval.py), are one vector per token of a query or a page image.

A page image runs through the vision tower (qwen2_vision.py) and its merged tokens take the places of the
`<|image_pad|>` placeholders in the language model's input (the engine's rules expand them to the image's
token count); queries are text alone. The language model is the Qwen2 decoder (llama.py), causal.

Positions: M-RoPE, as the weights were trained. colpali-engine (the authors' library, which trained and
published the ColQwen2 checkpoints) subclasses transformers' Qwen2VLModel and calls it with the input ids,
pixels and image grids, so Qwen2-VL rotates by its 3-D positions (models/mrope.py): text tokens advance
temporal, height and width together; an image's tokens take its grid's (frame, row, column), and the text after
it continues past the image's largest position. We do the same (`mrope`: the input builder computes them), so
page vectors equal colpali-engine's framing: transformers' Qwen2VLModel given input_ids, pixel_values and
image_grid_thw, then the projection and L2 norm. Queries (text alone) rotate by plain positions in either.

transformers' own ColQwen2ForRetrieval (5.x) differs on pages: it calls its Qwen2-VL model with input embeddings
and no ids or grids, so every token, image ones included, rotates by its plain index (ordinary RoPE). Its page
vectors are therefore not the ones the checkpoints were trained to give; we follow the authors. A user who must
reproduce ColQwen2ForRetrieval's vectors bit for bit runs it in transformers; embedserv serves one framing.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from embedserv.models.families.llama import LlamaStack
from embedserv.models.families.qwen2_vision import Qwen2VisionTower
from embedserv.models.interface import DecoderModel
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs
from embedserv.models.mrope import MRopeSpec

# transformers' Qwen2VLRotaryEmbedding's sections where the config names none.
DEFAULT_MROPE_SECTION = [16, 24, 24]


def text_config(config):
    """The language model's config, read as Qwen2's (q/k/v biases, no output bias: llama._biases), with its M-RoPE
    sections."""
    text = copy.copy(config.vlm_config.get_text_config())
    text.model_type = "qwen2"
    text.rope_parameters = {"mrope_section": DEFAULT_MROPE_SECTION, **(text.rope_parameters or {})}
    return text


class ColQwen2Model(nn.Module, DecoderModel):
    """`forward(input_ids, positions, pixel_values=None, image_grids=()) -> [num_tokens, hidden]`: image
    features at the placeholder tokens, in the order of `image_grids` (the packed order); positions [3,
    num_tokens] (M-RoPE), or [num_tokens] (plain RoPE: all three alike)."""

    takes_images = True
    text_config = staticmethod(text_config)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vlm = config.vlm_config
        self.image_token_id = int(vlm.image_token_id)
        self.language_model = LlamaStack(text_config(config))
        self.visual = Qwen2VisionTower(vlm.vision_config, first_layer_index=len(self.language_model.layers))
        self.mrope = MRopeSpec(self.image_token_id, int(vlm.vision_config.spatial_merge_size))

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
    tested_by=(
        "tests/models/test_colqwen2_parity.py",
        "tests/models/test_vision_retrieval_engine.py",
        "tests/unit/test_mrope_positions.py",
        "tests/unit/test_mrope_rotary.py",
    ),
)
