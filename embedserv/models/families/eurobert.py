"""EuroBERT encoders over a flat packed batch: Llama's architecture, attending both ways.

RMSNorm -> attention with rotary positions and grouped KV heads -> RMSNorm -> gated SiLU MLP, a final
RMSNorm: the Llama family's layers run it unchanged (models/families/llama.py); what differs is that the
family is an encoder (bidirectional attention, no KV cache) and its classification head. EuroBERT's
`attention_bias` covers q/k/v and the output projection, as Llama's does.

Published checkpoints (EuroBERT/EuroBERT-210m, ...) predate transformers' native `eurobert` type: their
config.json points at custom code (auto_map) and spells some settings the pre-5 way (`rope_theta`,
`rope_scaling`, `clf_pooling`). `native_config` reads that form as the native one; their backbone tensor names are the
native ones already (`model.` under *ForMaskedLM / *ForSequenceClassification).
"""

from __future__ import annotations

from typing import ClassVar

from embedserv.errors import ConfigError
from embedserv.models.families.llama import LlamaStack
from embedserv.models.interface import EncoderModel
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Classifier, Family, FamilyDocs


def native_config(raw: dict) -> dict | None:
    """A published (custom-code) EuroBERT config.json as transformers' native `eurobert` config dict, or None
    when it is in the native form already (`rope_parameters`, no auto_map)."""
    if "auto_map" not in raw and "rope_parameters" in raw:
        return None
    native = {key: value for key, value in raw.items() if key not in ("auto_map", "rope_theta", "rope_scaling")}
    rope = dict(raw.get("rope_scaling") or {})
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    if raw.get("rope_theta") is not None:
        rope["rope_theta"] = raw["rope_theta"]
    native["rope_parameters"] = raw.get("rope_parameters") or rope
    if "clf_pooling" in native:
        native["classifier_pooling"] = native.pop("clf_pooling")
    native["model_type"] = "eurobert"
    return native


class EuroBertModel(LlamaStack, EncoderModel):
    """`forward(input_ids, positions) -> [num_tokens, hidden]`, final norm applied."""

    config_forms: ClassVar[dict] = {"eurobert": native_config}

    def __init__(self, config) -> None:
        # The Llama layers give an MLP bias to model type "llama" only; no published EuroBERT has one.
        if getattr(config, "mlp_bias", False):
            raise ConfigError("EuroBERT with mlp_bias is not supported (no published checkpoint has MLP biases)")
        super().__init__(config)


# Names a ForMaskedLM / ForSequenceClassification checkpoint uses (with `model.`), or sentence-transformers
# (bare backbone names). The MLM head and the classifier (`dense`, `classifier` or `out_proj`) are not
# backbone weights.
CHECKPOINT = CheckpointNames(
    prefixes=("model.",),
    ignored=r"^(lm_head\.|dense\.|classifier\.|out_proj\.|rotary_emb\.)",
    packed=QKV_GATE_UP,
)


def _classifier_token(config) -> str:
    """classifier_pooling "bos" reads the first token, "mean" every token; "late" (the default) runs dense +
    GELU on every token and averages the logits."""
    pooling = config.classifier_pooling
    if pooling not in ("bos", "mean", "late"):
        raise ConfigError(f"EuroBERT classifier_pooling {pooling!r} is not supported; supported: 'bos', 'mean', 'late'")
    return {"bos": "first", "mean": "mean", "late": "late"}[pooling]


# EuroBertForSequenceClassification: pooled token(s) -> dense (with bias) -> exact GELU -> classifier (named
# `out_proj` by the first published custom code).
CLASSIFIER = Classifier(
    token=_classifier_token,
    pooler=True,
    sources={
        "dense.weight": ("dense.weight",),
        "dense.bias": ("dense.bias",),
        "out.weight": ("classifier.weight", "out_proj.weight"),
        "out.bias": ("classifier.bias", "out_proj.bias"),
    },
    activation="gelu",
)

FAMILY = Family(
    name="eurobert",
    model_types=("eurobert",),
    model_class=EuroBertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"EuroBertForSequenceClassification": CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=("EuroBERT/EuroBERT-210m", "EuroBERT/EuroBERT-610m", "EuroBERT/EuroBERT-2.1B"),
    tested_by=("tests/models/test_eurobert_parity.py",),
)
