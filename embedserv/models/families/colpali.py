"""ColPali (transformers' ColPaliForRetrieval): a PaliGemma model whose last hidden states, projected and
L2-normalized (models/heads/vision_retrieval.py), are one vector per token of a query or a page image.

PaliGemma: a SigLIP vision tower without its pooling head (families/siglip.SiglipVisionStates) and a linear
projector make one language-model token per patch; they take the places of the `<image>` placeholders (the
engine's rules put image_seq_length of them first); the language model is Gemma (v1: RMSNorm scaled by
1 + weight, GeLU-gated MLP, embeddings times sqrt(hidden_size)). The image features are not scaled
(transformers 5 scales only the token embeddings). As transformers runs it:
- attention is bidirectional over the whole sequence, query or page: PaliGemmaConfig sets the text config's
  use_bidirectional_attention (the language config, the model class's text_config, carries it to causality);
- positions start at 1 (position_offset).
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.models.families.gemma import Gemma3RMSNorm, GemmaMLP, embedding_scale
from embedserv.models.families.llama import LlamaAttention
from embedserv.models.families.siglip import SiglipVisionStates
from embedserv.models.interface import DecoderModel
from embedserv.models.layers import head_dim
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding


def language_config(config):
    return config.vlm_config.text_config


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = self.self_attn(self.input_layernorm(hidden), hidden, cos, sin)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class ColPaliModel(nn.Module, DecoderModel):
    """`forward(input_ids, positions, pixel_values=None, image_grids=()) -> [num_tokens, hidden]`: image
    features at the placeholder tokens, images in packed order."""

    position_offset = 1
    takes_images = True
    text_config = staticmethod(language_config)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vlm, text = config.vlm_config, language_config(config)
        self.image_token_id = int(vlm.image_token_id)
        self.vocab_size = text.vocab_size
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(text, i) for i in range(text.num_hidden_layers))
        self.norm = Gemma3RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.rotary = RotaryEmbedding(text, head_dim(text), self.max_positions + self.position_offset)
        self.vision_tower = SiglipVisionStates(vlm.vision_config, first_layer_index=text.num_hidden_layers)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(vlm.vision_config.hidden_size, vlm.vision_config.projection_dim)

    @property
    def max_positions(self) -> int:
        return language_config(self.config).max_position_embeddings

    def forward(self, input_ids, positions, pixel_values=None, image_grids=()) -> torch.Tensor:
        is_image = input_ids == self.image_token_id
        # transformers embeds an out-of-vocabulary image token as id 0 (its features replace it anyway).
        ids = input_ids.masked_fill(is_image, 0) if self.image_token_id >= self.vocab_size else input_ids
        embed = self.embed_tokens(ids)
        hidden = embed * embedding_scale(language_config(self.config).hidden_size ** 0.5, embed.dtype)
        if pixel_values is not None:
            features = self.vision_tower(pixel_values.to(hidden.dtype))
            features = self.multi_modal_projector.linear(features)
            # Padding rows after the images' have no placeholder: masked_scatter takes the first rows only.
            hidden = hidden.masked_scatter(is_image.unsqueeze(-1), features.to(hidden.dtype))
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


CHECKPOINT = CheckpointNames(
    prefixes=("vlm.model.", "vlm."),
    # The projection is the token head's (models/heads/vision_retrieval.py); the LM head is not used.
    ignored=r"^(embedding_proj_layer\.|(language_model\.)?lm_head\.|.*position_ids$)",
    packed=QKV_GATE_UP,
    # transformers 5 saves `language_model.model.` and `vision_tower.`; earlier saves (the hub's) nest the tower
    # in `vision_tower.vision_model.`.
    renames=((r"^language_model\.(model\.)?", ""), (r"^vision_tower\.vision_model\.", "vision_tower.")),
)

FAMILY = Family(
    name="colpali",
    model_types=("colpali",),
    model_class=ColPaliModel,
    checkpoint=CHECKPOINT,
    is_encoder=False,
)

DOCS = FamilyDocs(
    examples=("vidore/colpali-v1.3-hf",),
    tested_by=("tests/models/test_colpali_parity.py", "tests/models/test_vision_retrieval_engine.py"),
)
