"""NomicBERT (nomic-embed-text v1 / v1.5) over a flat packed batch.

BERT's post-norm blocks with rotary positions instead of position embeddings, a SwiGLU MLP, and no
biases in attention or MLP. transformers calls it `nomic_bert`; the published checkpoints carry the
custom code's GPT-2-style config keys (n_embd, n_layer, ...) and its tensor names (emb_ln, attn.Wqkv,
mlp.fc11 / fc12 / fc2, norm1 / norm2): both forms load (config_forms and the renames below).
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.errors import ConfigError
from embedserv.models.layers import Linear, get_activation, packed_linear
from embedserv.models.loading.family import CheckpointNames, Classifier, Family
from embedserv.models.rotary import RotaryEmbedding, apply_rotary


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden)


class NomicBertAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        size = self.num_heads * self.head_dim
        # Query, key and value in one matmul (the published checkpoints store them so: attn.Wqkv).
        self.qkv = packed_linear(config.hidden_size, (size,) * 3, bias=False)
        self.attn = Attention(self.num_heads, self.head_dim, layer_index=layer_index)
        self.o_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of `x`, plus `x` (the residual, fused into the output projection)."""
        qk, v = self.qkv(x).split((2 * self.num_heads * self.head_dim, self.num_heads * self.head_dim), dim=-1)
        # Queries and keys sit side by side in the fused output: one rotation covers both.
        qk = apply_rotary(qk.view(-1, 2 * self.num_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v), residual=x)


class NomicBertMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        # Gate and up projections in one matmul; the loader stacks their weights.
        self.gate_up = packed_linear(config.hidden_size, (config.intermediate_size,) * 2, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, residual=x)


class NomicBertLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.self_attn = NomicBertAttention(config, layer_index)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = NomicBertMLP(config)
        self.post_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin))
        return self.post_mlp_layernorm(self.mlp(hidden))


class NomicBertModel(nn.Module):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.position_offset = 0
        self.embeddings = NomicBertEmbeddings(config)
        self.layers = nn.ModuleList(NomicBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config, config.head_dim, self.max_positions)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, token_type_ids)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return hidden


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


# NomicBertModel names (bare), NomicBertForSequenceClassification / ForMaskedLM (under `nomic_bert.`), and the
# published custom code's (encoder.layers.N.attn.Wqkv, ...; fc11 is the up projection, fc12 the gate).
CHECKPOINT = CheckpointNames(
    prefixes=("nomic_bert.", "bert.", "model."),
    ignored=r"^(pooler\.|cls\.|classifier\.|lm_head\.|embeddings\.(position_ids|token_type_ids)|rotary_emb\.)",
    packed=(
        ("self_attn.q_proj.", "self_attn.qkv.", 0),
        ("self_attn.k_proj.", "self_attn.qkv.", 1),
        ("self_attn.v_proj.", "self_attn.qkv.", 2),
        ("mlp.gate_proj.", "mlp.gate_up.", 0),
        ("mlp.up_proj.", "mlp.gate_up.", 1),
        ("mlp.fc12.", "mlp.gate_up.", 0),
        ("mlp.fc11.", "mlp.gate_up.", 1),
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
    config_forms={"nomic_bert": published_config},
    examples=("nomic-ai/nomic-embed-text-v1", "nomic-ai/nomic-embed-text-v1.5", "nomic-ai/nomic-bert-2048"),
    tested_by=("tests/models/test_nomic_bert_parity.py", "tests/unit/test_rotary_ntk.py"),
)
