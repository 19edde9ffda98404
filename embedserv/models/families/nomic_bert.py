"""NomicBERT (nomic-embed-text v1 / v1.5) over a flat packed batch.

BERT's post-norm blocks with rotary positions instead of position embeddings, a SwiGLU MLP, and no
biases in attention or MLP: Alibaba GTE's blocks (gte.py) with their biases off. transformers calls it
`nomic_bert`; the published checkpoints carry the custom code's GPT-2-style config keys (n_embd, n_layer,
...) and its tensor names (emb_ln, attn.Wqkv, mlp.fc11 / fc12 / fc2, norm1 / norm2): both forms load
(config_forms and the renames below).
"""

from __future__ import annotations

from typing import ClassVar

from embedserv.errors import ConfigError
from embedserv.models.families.gte import GteModel
from embedserv.models.loading.family import QKV, CheckpointNames, Classifier, Family, FamilyDocs

# The published config.json's keys that the native form has no switch for, and the only value it matches.
_PUBLISHED_FIXED = {
    "prenorm": False,
    "parallel_block": False,
    "causal": False,
    "use_rms_norm": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "activation_function": "swiglu",
    "moe_every_n_layers": 0,
}


def published_config(raw: dict) -> dict | None:
    """nomic-ai/nomic-bert-2048's GPT-2-style config.json (n_embd, n_layer, ...) as the native nomic_bert
    config dict; None for a native dict. Refuses, naming the key, what the native architecture cannot run."""
    if "n_embd" not in raw:
        return None
    for key, value in _PUBLISHED_FIXED.items():
        if raw.get(key, value) != value:
            raise ConfigError(
                f"nomic_bert config.json has {key}={raw[key]!r}; embedserv serves only {key}={value!r} "
                "(the architecture transformers' nomic_bert implements)"
            )
    # The custom code rounds the embedding rows up to a multiple, and its checkpoints hold that many.
    multiple = raw.get("pad_vocab_size_multiple", 1)
    vocab_size = -(-raw["vocab_size"] // multiple) * multiple
    native = {
        "model_type": "nomic_bert",
        "vocab_size": vocab_size,
        "hidden_size": raw["n_embd"],
        "num_hidden_layers": raw["n_layer"],
        "num_attention_heads": raw["n_head"],
        "intermediate_size": raw.get("n_inner") or 4 * raw["n_embd"],
        # SwiGLU: silu of the gate times the up projection.
        "hidden_act": "silu",
        "max_position_embeddings": raw.get("n_positions", 2048),
        "type_vocab_size": raw.get("type_vocab_size", 2),
        "layer_norm_eps": raw.get("layer_norm_epsilon", 1e-12),
        "pad_token_id": raw.get("pad_token_id") or 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(raw.get("rotary_emb_base", 10_000))},
    }
    for key in ("architectures", "id2label", "label2id", "problem_type"):
        if key in raw:
            native[key] = raw[key]
    return native


class NomicBertModel(GteModel):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`: GTE's blocks without biases."""

    biases = False
    config_forms: ClassVar[dict] = {"nomic_bert": published_config}


# NomicBertModel names (bare), NomicBertForSequenceClassification / ForMaskedLM (under `nomic_bert.`), and the
# published custom code's (encoder.layers.N.attn.Wqkv, ...; fc11 is the up projection, fc12 the gate).
CHECKPOINT = CheckpointNames(
    prefixes=("nomic_bert.", "bert.", "model."),
    ignored=r"^(pooler\.|cls\.|classifier\.|lm_head\.|embeddings\.(position_ids|token_type_ids)|rotary_emb\.)",
    packed=(
        *QKV,
        # gte.py packs up before gate.
        ("mlp.up_proj.", "mlp.up_gate.", 0),
        ("mlp.gate_proj.", "mlp.up_gate.", 1),
        ("mlp.fc11.", "mlp.up_gate.", 0),
        ("mlp.fc12.", "mlp.up_gate.", 1),
    ),
    renames=(
        (r"^emb_ln\.", "embeddings.LayerNorm."),
        (r"^encoder\.layers\.", "layers."),
        (r"\.attn\.Wqkv\.", ".self_attn.qkv."),
        (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
        (r"\.norm1\.", ".post_attention_layernorm."),
        (r"\.norm2\.", ".post_mlp_layernorm."),
    ),
)

# As BERT's: the first token through the pooler's dense + tanh, then `classifier`.
_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    sources={
        "dense.weight": ("nomic_bert.pooler.dense.weight", "pooler.dense.weight"),
        "dense.bias": ("nomic_bert.pooler.dense.bias", "pooler.dense.bias"),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
)

FAMILY = Family(
    name="nomic_bert",
    model_types=("nomic_bert",),
    model_class=NomicBertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"NomicBertForSequenceClassification": _CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=("nomic-ai/nomic-embed-text-v1", "nomic-ai/nomic-embed-text-v1.5", "nomic-ai/nomic-bert-2048"),
    tested_by=("tests/models/test_nomic_bert_parity.py", "tests/unit/test_rotary_ntk.py"),
)
