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

from embedserv.models.families.qwen2_vl import Qwen2VLEmbedder
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs


class ColQwen2Model(Qwen2VLEmbedder):
    """Qwen2-VL's model (qwen2_vl.py) under ColQwen2's config, which nests it in `vlm_config`."""

    @staticmethod
    def vlm_config(config):
        return config.vlm_config


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
