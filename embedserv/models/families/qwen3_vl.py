"""Qwen3-VL (Qwen3VLForConditionalGeneration, Qwen3VLModel) as a last-token embedder (Qwen3-VL-Embedding style):
Qwen2-VL's embedder (qwen2_vl.py) with Qwen3-VL's vision tower (qwen3_vision.py), the Qwen3 decoder (llama.py:
RMSNorm on each head's queries and keys, no q/k/v biases), M-RoPE with the sections' frequencies interleaved
(rotary.py: t, h, w, t, h, w, ... as transformers' Qwen3VLTextRotaryEmbedding lays them out) and DeepStack: the
tower's extra features are added to the image tokens' hidden states after each of the first decoder layers
(one layer per feature), as transformers' Qwen3VLTextModel does. An image's M-RoPE positions are Qwen2-VL's
(models/mrope.py). Inputs are framed as Qwen3-VL-Embedding frames them (engine/inputs/vl_embed_rules.QWEN3_VL_FRAMING).

A Qwen3VLForConditionalGeneration detected as a yes/no reranker (Qwen3-VL-Reranker: models/loading/tasks.py) reads
the last token's state through the "yes" and "no" rows of its LM head (the token embeddings when tied), framed by
engine/inputs/vl_rerank_rules.py; the rest of the LM head is never read.
"""

from __future__ import annotations

import torch

from embedserv.models.families.qwen2_vl import CHECKPOINT, EMBEDDINGS, Qwen2VLEmbedder, vl_text_config
from embedserv.models.families.qwen3_vision import Qwen3VisionTower
from embedserv.models.loading.family import Family, FamilyDocs


class Qwen3VLEmbedder(Qwen2VLEmbedder):
    tower_class = Qwen3VisionTower

    @classmethod
    def text_config(cls, config):
        """The language model read as Qwen3's (q/k norms), its M-RoPE interleaved whatever the config says:
        transformers' Qwen3-VL always interleaves."""
        return vl_text_config(cls.vlm_config(config), "qwen3", mrope_interleaved=True)

    def forward(self, input_ids, positions, pixel_values=None, image_grids=()) -> torch.Tensor:
        model = self.language_model
        hidden = model.embed_tokens(input_ids)
        deepstack, image_mask = [], None
        if pixel_values is not None:
            features, deepstack = self.visual(pixel_values, tuple(image_grids))
            image_mask = (input_ids == self.image_token_id).unsqueeze(-1)
            hidden = hidden.masked_scatter(image_mask, features.to(hidden.dtype))
        cos, sin = model.rotary(positions)
        for index, layer in enumerate(model.layers):
            hidden = layer(hidden, cos, sin)
            if index < len(deepstack):
                # Scattered into zeros and added, not indexed by the mask's rows: nonzero() would wait for the
                # device on every step.
                extra = torch.zeros_like(hidden).masked_scatter(image_mask, deepstack[index].to(hidden.dtype))
                hidden = hidden + extra
        return model.norm(hidden)


FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    model_class=Qwen3VLEmbedder,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    embeddings=EMBEDDINGS,
    pooling="lasttoken",
)

DOCS = FamilyDocs(
    # Qwen3-VL-Embedding's framing follows its repository's qwen3_vl_embedding.py; no published checkpoint's
    # vectors were compared (no download here).
    examples=(),
    tested_by=(
        "tests/models/test_qwen_vl_embed_parity.py",
        "tests/models/test_qwen_vl_embed_engine.py",
        "tests/models/test_qwen_vl_rerank.py",
        "tests/unit/test_mrope_rotary.py",
    ),
)
