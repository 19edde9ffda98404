"""Alibaba's GTE v1.5 / multilingual encoders (transformers' `gte`) over a flat packed batch.

BERT's post-norm blocks with rotary positions (NTK-scaled where the config says so) instead of position
embeddings and a gated GELU MLP; attention projections and the down projection carry biases, the gated
up projection none. The published checkpoints (gte-base-en-v1.5, gte-multilingual-base and its reranker)
carry config.json with model_type "new" and the custom code's (Alibaba-NLP/new-impl) keys and tensor
names (encoder.layer.N.attention.qkv_proj, mlp.up_gate_proj, attn_ln, mlp_ln); Snowflake's arctic-embed
v2.0 the same keys and names under model_type "gte". Both forms load (config_forms and the renames below).
The custom code's unpadding and memory-efficient attention switches change nothing in the math.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.errors import ConfigError
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear, get_activation, head_dim, packed_linear
from embedserv.models.loading.family import QKV, CheckpointNames, Classifier, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding, apply_rotary

# new-impl switches the native architecture has no counterpart for, and the only value it matches.
_PUBLISHED_FIXED = {
    "layer_norm_type": "layer_norm",
    "logn_attention_scale": False,
    "position_embedding_type": "rope",
    "pack_qkv": True,
}
# new-impl keys that say how its code runs, not what it computes (or that are checked above).
_PUBLISHED_ONLY = (
    "auto_map",
    "rope_scaling",
    "rope_theta",
    "unpad_inputs",
    "use_memory_efficient_attention",
    "logn_attention_clip1",
    *_PUBLISHED_FIXED,
)
# new-impl's NewConfig defaults where transformers' GteConfig has others.
_PUBLISHED_DEFAULTS = {"max_position_embeddings": 2048, "type_vocab_size": 1, "hidden_act": "gelu"}


def published_config(raw: dict) -> dict | None:
    """A config.json of Alibaba-NLP/new-impl (model_type "new", or "gte" with its keys, as Snowflake's
    arctic-embed v2.0) as the native gte config dict; None for a native gte dict. Refuses, naming the key,
    what the native architecture cannot run."""
    if raw.get("model_type") == "gte" and not any(key in raw for key in _PUBLISHED_ONLY):
        return None
    for key, value in _PUBLISHED_FIXED.items():
        if raw.get(key, value) != value:
            raise ConfigError(
                f"{raw.get('model_type')} config.json has {key}={raw[key]!r}; embedserv serves only {key}={value!r} "
                "(the architecture transformers' gte implements)"
            )
    native = {key: value for key, value in raw.items() if key not in _PUBLISHED_ONLY}
    native["model_type"] = "gte"
    for key, value in _PUBLISHED_DEFAULTS.items():
        native.setdefault(key, value)
    native["rope_parameters"] = _rope_parameters(raw)
    return native


def _rope_parameters(raw: dict) -> dict:
    """new-impl's rope_theta (default 10000) and rope_scaling (None, or NTK: models/rotary.py's "ntk")."""
    params = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10_000.0))}
    scaling = raw.get("rope_scaling")
    if scaling:
        kind = scaling.get("type") or scaling.get("rope_type")
        if kind != "ntk":
            raise ConfigError(
                f"{raw.get('model_type')} config.json has rope_scaling type {kind!r}; only 'ntk' is served"
            )
        params.update(rope_type="ntk", factor=float(scaling["factor"]))
        if scaling.get("mixed_b") is not None:
            params["mixed_b"] = float(scaling["mixed_b"])
    return params


class GteEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        # gte-base-en-v1.5 has no token types (type_vocab_size 0); the others one row or more.
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                hidden = hidden + self.token_type_embeddings.weight[0]
            else:
                hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class GteAttention(nn.Module):
    def __init__(self, config, layer_index: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = head_dim(config)
        size = self.num_heads * self.head_dim
        # Query, key and value in one matmul (the published checkpoints store them so: qkv_proj).
        self.qkv = packed_linear(config.hidden_size, (size,) * 3, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, layer_index=layer_index)
        self.o_proj = Linear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of `x`, plus `x` (the residual, fused into the output projection)."""
        size = self.num_heads * self.head_dim
        qk, v = self.qkv(x).split((2 * size, size), dim=-1)
        # Queries and keys sit side by side in the fused output: one rotation covers both.
        qk = apply_rotary(qk.view(-1, 2 * self.num_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v), residual=x)


class GteMLP(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        # Up and gate projections in one matmul, in the published checkpoints' order (up_gate_proj).
        self.up_gate = packed_linear(config.hidden_size, (config.intermediate_size,) * 2, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, residual=x)


class GteLayer(nn.Module):
    def __init__(self, config, layer_index: int, bias: bool) -> None:
        super().__init__()
        self.self_attn = GteAttention(config, layer_index, bias)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GteMLP(config, bias)
        self.post_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin))
        return self.post_mlp_layernorm(self.mlp(hidden))


class GteModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

    reads_token_types = True
    config_forms: ClassVar[dict] = {"new": published_config, "gte": published_config}
    # The attention projections and the down projection carry biases (NomicBERT's, the same blocks, none).
    biases = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = GteEmbeddings(config)
        self.layers = nn.ModuleList(GteLayer(config, i, self.biases) for i in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config, head_dim(config), self.max_positions)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, token_type_ids)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


# GteModel names (bare), GteForSequenceClassification / ForMaskedLM (under `gte.`), new-impl's (bare, or
# under `new.` in its task models): encoder.layer.N.attention.qkv_proj, mlp.up_gate_proj, attn_ln, mlp_ln.
CHECKPOINT = CheckpointNames(
    prefixes=("gte.", "new."),
    ignored=r"^(pooler\.|classifier\.|lm_head\.|embeddings\.position_ids|rotary_emb\.)",
    packed=(
        *QKV,
        ("mlp.up_proj.", "mlp.up_gate.", 0),
        ("mlp.gate_proj.", "mlp.up_gate.", 1),
    ),
    renames=(
        (r"^encoder\.layer\.", "layers."),
        (r"\.attention\.qkv_proj\.", ".self_attn.qkv."),
        (r"\.attention\.o_proj\.", ".self_attn.o_proj."),
        (r"\.mlp\.up_gate_proj\.", ".mlp.up_gate."),
        (r"\.attn_ln\.", ".post_attention_layernorm."),
        (r"\.mlp_ln\.", ".post_mlp_layernorm."),
    ),
)

# As BERT's: the first token through the pooler's dense + tanh, then `classifier`.
_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    sources={
        "dense.weight": ("gte.pooler.dense.weight", "new.pooler.dense.weight", "pooler.dense.weight"),
        "dense.bias": ("gte.pooler.dense.bias", "new.pooler.dense.bias", "pooler.dense.bias"),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
)

FAMILY = Family(
    name="gte",
    model_types=("gte",),
    model_class=GteModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"GteForSequenceClassification": _CLASSIFIER, "NewForSequenceClassification": _CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=(
        "Alibaba-NLP/gte-base-en-v1.5",
        "Alibaba-NLP/gte-large-en-v1.5",
        "Alibaba-NLP/gte-multilingual-base",
        "Alibaba-NLP/gte-multilingual-reranker-base",
        "Snowflake/snowflake-arctic-embed-m-v2.0",
    ),
    tested_by=("tests/models/test_gte_parity.py", "tests/unit/test_rotary_ntk.py"),
)
