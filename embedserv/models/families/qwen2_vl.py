"""Qwen2-VL (Qwen2VLForConditionalGeneration, Qwen2VLModel) as an embedder: GME and DSE style, one vector per
input from the last token's final hidden state (last-token pooling, then L2 norm and Matryoshka dimensions as
for every embedder). Texts, images and an image with text, framed as their chat template frames them
(engine/inputs/vl_embed_rules.py).

An image runs through the vision tower (qwen2_vision.py) and its merged tokens take the places of the
`<|image_pad|>` placeholders in the language model's input; the language model is the Qwen2 decoder
(llama.py), causal, rotated by M-RoPE (models/mrope.py: the input builder computes the 3-D positions from each
image's grid), as transformers' Qwen2VLModel does given input_ids, pixel_values and image_grid_thw. The LM head
is not used.
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


def vl_text_config(vlm, model_type: str = "qwen2", **rope):
    """A Qwen2-VL-style config's language model, read as `model_type`'s (Qwen2: q/k/v biases, no output bias,
    llama._biases; Qwen3: q/k norms), with its M-RoPE sections and the `rope` parameters given."""
    text = copy.copy(vlm.get_text_config())
    text.model_type = model_type
    text.rope_parameters = {"mrope_section": DEFAULT_MROPE_SECTION, **(text.rope_parameters or {}), **rope}
    return text


class Qwen2VLEmbedder(nn.Module, DecoderModel):
    """`forward(input_ids, positions, pixel_values=None, image_grids=()) -> [num_tokens, hidden]`: image
    features at the placeholder tokens, in the order of `image_grids` (the packed order); positions [3,
    num_tokens] (M-RoPE). Subclasses pick the tower (Qwen2.5-VL) or where the config nests (ColQwen2)."""

    takes_images = True
    tower_class = Qwen2VisionTower

    @staticmethod
    def vlm_config(config):
        """The Qwen2-VL-style config inside the model's config (ColQwen2's nests it)."""
        return config

    @classmethod
    def tower_for(cls, vlm):
        """The vision tower's class for the Qwen2-VL-style config `vlm`."""
        return cls.tower_class

    @classmethod
    def text_config(cls, config):
        return vl_text_config(cls.vlm_config(config))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vlm = self.vlm_config(config)
        self.image_token_id = int(vlm.image_token_id)
        self.language_model = LlamaStack(self.text_config(config))
        self.visual = self.tower_for(vlm)(vlm.vision_config, first_layer_index=len(self.language_model.layers))
        self.vision_windows = self.visual.vision_windows
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
    # transformers 5 saves `model.language_model.` and `model.visual.` (Qwen2VLModel: without `model.`); hub
    # checkpoints saved before it (GME's, DSE's) keep the language model under `model.` and `visual.` apart.
    prefixes=("model.",),
    ignored=r"^(lm_head\.|(language_model\.)?rotary_emb\.)",
    packed=QKV_GATE_UP,
    renames=((r"^(embed_tokens|layers|norm)\.", r"language_model.\1."),),
)

# The token embeddings under each layout CHECKPOINT reads: a tied LM head's rows (a yes/no reranker's, heads/score.py).
EMBEDDINGS = (
    "model.language_model.embed_tokens.weight",
    "model.embed_tokens.weight",
    "language_model.embed_tokens.weight",
)

FAMILY = Family(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    model_class=Qwen2VLEmbedder,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    pooling="lasttoken",
)

DOCS = FamilyDocs(
    examples=("Alibaba-NLP/gme-Qwen2-VL-2B-Instruct", "MrLight/dse-qwen2-2b-mrl-v1"),
    tested_by=("tests/models/test_qwen_vl_embed_parity.py", "tests/models/test_qwen_vl_embed_engine.py"),
)
