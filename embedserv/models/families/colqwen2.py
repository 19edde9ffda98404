"""ColQwen2 and ColQwen2.5 (transformers' ColQwen2ForRetrieval): a Qwen2-VL or Qwen2.5-VL model whose last hidden
states, projected and L2-normalized (models/heads/vision_retrieval.py), are one vector per token of a query or a page
image.

ColQwen2.5 is the same retriever on Qwen2.5-VL: ColQwen2ForRetrieval's `vlm_config` is a `qwen2_5_vl` config, which
transformers' AutoModel builds as Qwen2_5_VLModel; we take Qwen2.5-VL's tower (qwen2_5_vision.py: windowed
attention) and the rest unchanged (its M-RoPE positions for images are Qwen2-VL's).

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

Checkpoint layouts served:
- transformers' (`vidore/colqwen2-v1.0-hf`): model_type `colqwen2`, architectures ColQwen2ForRetrieval, the
  model under `vlm.` (or `vlm.model.`), the projection `embedding_proj_layer`; ColQwen2.5 the same with a
  `qwen2_5_vl` vlm_config.
- colpali-engine's, merged (`vidore/colqwen2.5-base`, and a LoRA release such as `vidore/colqwen2.5-v0.2` once
  merged into it with peft's merge_and_unload): the Qwen2-VL / Qwen2.5-VL config itself (model_type `qwen2_vl` /
  `qwen2_5_vl`) with architectures ColQwen2 / ColQwen2_5 (`colpali_engine_config` reads it as ColQwen2's), the
  model's tensors as Qwen2(.5)-VL saves them (`model.` + `visual.`, or `language_model.` + `visual.`) and the
  projection `custom_text_proj` (width `dim`, 128 when the config names none: colpali-engine's default).
  The unmerged adapter directory (adapter_config.json alone) is refused, saying to merge it.
"""

from __future__ import annotations

from typing import ClassVar

from embedserv.errors import ConfigError
from embedserv.models.families.qwen2_5_vision import Qwen25VisionTower
from embedserv.models.families.qwen2_vision import Qwen2VisionTower
from embedserv.models.families.qwen2_vl import Qwen2VLEmbedder
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs

# The vision tower of the model ColQwen2ForRetrieval nests (`vlm_config.model_type`, as transformers' AutoModel
# picks it): ColQwen2 on Qwen2-VL, ColQwen2.5 on Qwen2.5-VL.
TOWERS = {"qwen2_vl": Qwen2VisionTower, "qwen2_5_vl": Qwen25VisionTower}
# colpali-engine's classes (config.json's architectures) over those models.
COLPALI_ENGINE_ARCHITECTURES = ("ColQwen2", "ColQwen2_5")
# colpali-engine's projection width where the config names none (`dim`).
COLPALI_ENGINE_DIM = 128


def colpali_engine_config(raw: dict) -> dict | None:
    """A colpali-engine ColQwen2 / ColQwen2.5 config.json (the Qwen2-VL / Qwen2.5-VL config, architectures
    ColQwen2 / ColQwen2_5) as transformers' `colqwen2` config dict, or None for any other Qwen2-VL config."""
    architectures = raw.get("architectures") or [""]
    if architectures[0] not in COLPALI_ENGINE_ARCHITECTURES:
        return None
    vlm = {key: value for key, value in raw.items() if key not in ("architectures", "auto_map", "dim")}
    return {
        "model_type": "colqwen2",
        "architectures": ["ColQwen2ForRetrieval"],
        "vlm_config": vlm,
        "embedding_dim": int(raw.get("dim") or COLPALI_ENGINE_DIM),
    }


class ColQwen2Model(Qwen2VLEmbedder):
    """Qwen2-VL's or Qwen2.5-VL's model (qwen2_vl.py, qwen2_5_vl.py) under ColQwen2's config, which nests it in
    `vlm_config`."""

    config_forms: ClassVar[dict] = {"qwen2_vl": colpali_engine_config, "qwen2_5_vl": colpali_engine_config}

    @staticmethod
    def vlm_config(config):
        return config.vlm_config

    @classmethod
    def tower_for(cls, vlm):
        model_type = getattr(vlm, "model_type", "qwen2_vl")
        if model_type not in TOWERS:
            raise ConfigError(
                f"ColQwen2 over a {model_type!r} model is not supported; its vlm_config's model_type must be one "
                f"of {', '.join(sorted(TOWERS))}"
            )
        return TOWERS[model_type]


CHECKPOINT = CheckpointNames(
    # transformers 5 saves `vlm.visual.` and `vlm.language_model.`; checkpoints saved before it (the hub's) nest
    # both under `vlm.model.` beside an unused `vlm.lm_head`.
    # colpali-engine's keep Qwen2(.5)-VL's own names: `model.` (the language model, or both under transformers 5)
    # and `visual.`, or `language_model.` and `visual.`.
    prefixes=("vlm.model.", "vlm.", "model."),
    # The projection is the token head's (models/heads/vision_retrieval.py).
    ignored=r"^(embedding_proj_layer\.|custom_text_proj\.|lm_head\.|(language_model\.)?rotary_emb\.)",
    packed=QKV_GATE_UP,
    renames=((r"^(embed_tokens|layers|norm)\.", r"language_model.\1."),),
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
