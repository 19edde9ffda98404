"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a flat packed batch.

One architecture: pre-norm blocks of RMSNorm -> attention with rotary positions and grouped KV heads
-> RMSNorm -> gated MLP. The members differ only in small switches read from the config: which
projections carry a bias, Qwen3's per-head RMSNorm on queries and keys, a head size set apart from
hidden_size / heads, and which layers attend within a sliding window. Whether attention is causal is not
the model's business: it comes from the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.models.interface import DecoderModel
from embedserv.models.layers import Linear, get_activation, head_dim, num_kv_heads, packed_linear
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Classifier, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """As transformers' LlamaRMSNorm: normalize in float32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _biases(config) -> tuple[bool, bool, bool]:
    """(qkv, o_proj, mlp) biases, as each transformers class decides them.

    Qwen2 always has q/k/v biases and never an output bias; Llama and Qwen3 follow `attention_bias`
    (Llama also `mlp_bias`); Mistral has none. Flags a class ignores are ignored here too.
    """
    kind = config.model_type
    if kind == "qwen2":
        return True, False, False
    if kind == "mistral":
        return False, False, False
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = kind == "llama" and bool(getattr(config, "mlp_bias", False))
    return attention_bias, attention_bias, mlp_bias


def layer_sliding_window(config, layer_index: int) -> int | None:
    """The window W layer `layer_index` attends within (a query at p sees the key at j only when
    p - j < W), or None: every earlier key.

    transformers' sliding mask keeps `kv > q - sliding_window`, so W = sliding_window. Mistral slides
    every layer when the window is set (its modeling ignores `layer_types`); Qwen2/Qwen3 configs null
    `sliding_window` on load unless `use_sliding_window`, and list per layer in `layer_types` which
    layers slide (by default those from `max_window_layers` on); Llama has no window.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or config.model_type == "llama":
        return None
    if config.model_type == "mistral":
        return int(window)
    layer_types = getattr(config, "layer_types", None)
    return int(window) if layer_types and layer_types[layer_index] == "sliding_attention" else None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads(config)
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias, o_bias, _ = _biases(config)
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = packed_linear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), bias=qkv_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            num_kv_heads=self.num_kv_heads,
            layer_index=layer_index,
            sliding_window=layer_sliding_window(config, layer_index),
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of the normed `x`, plus `residual` (fused into the output projection)."""
        qkv = self.qkv(x)
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Queries and keys sit side by side in the fused output: one rotation covers both.
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            q = apply_rotary(self.q_norm(q), cos, sin)
            k = apply_rotary(self.k_norm(k), cos, sin)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v), residual=residual)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        _, _, bias = _biases(config)
        # Gate and up projections in one matmul; the loader stacks their weights.
        self.gate_up = packed_linear(config.hidden_size, (config.intermediate_size,) * 2, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, residual=residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = self.self_attn(self.input_layernorm(hidden), hidden, cos, sin)
        return self.mlp(self.post_attention_layernorm(hidden), hidden)


class LlamaStack(nn.Module):
    """Llama's blocks over token embeddings, final norm applied: `forward(input_ids, positions) -> [num_tokens,
    hidden]`. The Llama decoders, EuroBERT's encoder and ColQwen2's language model are this stack."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, head_dim(config), self.max_positions)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(input_ids), positions)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The blocks and the final norm over input embeddings (vision-language models place image features
        among them first)."""
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class LlamaModel(LlamaStack, DecoderModel):
    """Llama, Mistral, Qwen2 and Qwen3 decoders."""


# Names a ForCausalLM / ForSequenceClassification checkpoint uses (with `model.`), or sentence-transformers
# (bare backbone names). Heads (the LM head, a classifier's `score`) are read by models/heads; some
# checkpoints carry rotary buffers.
CHECKPOINT = CheckpointNames(
    prefixes=("model.",),
    ignored=r"^(lm_head\.|score\.|(layers\.\d+\.self_attn\.)?rotary_emb\.)",
    packed=QKV_GATE_UP,
)
# Decoder classifiers read the last token through a bias-free linear `score`.
SCORE_CLASSIFIER = Classifier(token="last", pooler=False, sources={"out.weight": ("score.weight",)})
EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")

FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    model_class=LlamaModel,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    classifiers={
        f"{name}ForSequenceClassification": SCORE_CLASSIFIER for name in ("Llama", "Mistral", "Qwen2", "Qwen3")
    },
    embeddings=EMBEDDINGS,
)

DOCS = FamilyDocs(
    examples=(
        "intfloat/e5-mistral-7b-instruct",
        "Alibaba-NLP/gte-Qwen2-1.5B-instruct",
        "Qwen/Qwen3-Embedding-0.6B",
        "Qwen/Qwen3-Reranker-0.6B",
        "meta-llama/Llama-3.2-1B-Instruct",
    ),
    tested_by=tuple(
        f"tests/models/test_{name}.py"
        for name in ("decoder_parity", "llama_parts", "classify_parity", "generate_parity")
    ),
)
