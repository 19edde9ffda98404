"""Gemma 3 text decoders (Gemma3ForCausalLM, Gemma3TextModel as EmbeddingGemma ships it) over a flat
packed batch, and the parts Gemma 4 (gemma4.py) shares with them.

Gemma 3 is the Llama block with Gemma's habits: RMSNorm scaling by (1 + weight), a norm after attention
and after the MLP as well as before them ("sandwich" norms), per-head RMSNorm on queries and keys, a
GeLU-gated MLP, embeddings scaled by sqrt(hidden_size), and attention scaled by
`query_pre_attn_scalar ** -0.5` instead of the head size. Layers are "sliding_attention" or
"full_attention" (`layer_types`); each type has its own rotary settings (`rope_parameters[type]`), and
sliding layers attend within the window below. The final logit softcapping is the LM head's (heads/lm.py).
Gemma 2's attention logit softcapping would need every attention backend to cap scores: refused.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.models.interface import DecoderModel
from embedserv.models.layers import Linear, get_activation, head_dim, packed_linear
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding, apply_rotary

LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_sliding_window(config) -> int:
    """W of Gemma 3's sliding layers (a query at p sees the key at j only when |p - j| < W, and j <= p
    when causal).

    Causal: transformers' sliding mask keeps `kv > q - sliding_window`, so W = sliding_window.
    `use_bidirectional_attention` (EmbeddingGemma): the config halves the window when it loads
    (`sliding_window // 2 + 1`, the value read here) and the mask ORs the causal window with
    `|q - kv| < sliding_window`, which contains it: W = sliding_window again.
    """
    if config.sliding_window is None:
        raise ValueError("the config has sliding_attention layers but no sliding_window")
    return int(config.sliding_window)


def check_layer_types(config) -> list[str]:
    types = list(config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return types


@cache
def embedding_scale(value: float, dtype: torch.dtype) -> float:
    """transformers keeps Gemma's embedding scales as float32 tensors cast to the weights' dtype (sqrt(3072)
    becomes 55.5 in bfloat16): the same rounding here (computed once per value and dtype, on the host)."""
    return torch.tensor(value).to(dtype).item()


class Gemma3RMSNorm(nn.Module):
    """As transformers' Gemma3RMSNorm: normalize in float32, scale by (1 + weight) in float32, cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul (the loader stacks their weights)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.gate_up = packed_linear(hidden_size, (intermediate_size,) * 2, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_index: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.sizes = (self.num_heads * self.head_dim,) + (self.num_kv_heads * self.head_dim,) * 2
        self.qkv = packed_linear(config.hidden_size, self.sizes, bias=config.attention_bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale=config.query_pre_attn_scalar**-0.5,
            num_kv_heads=self.num_kv_heads,
            layer_index=layer_index,
            sliding_window=sliding_window,
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        q = apply_rotary(self.q_norm(q.view(-1, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, sliding_window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_type = config.layer_types[layer_index]
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_index, sliding_window)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module, DecoderModel):
    """`forward(input_ids, positions) -> [num_tokens, hidden]`, final norm applied."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "attention logit softcapping (attn_logit_softcapping) is not supported: "
                "no attention backend caps scores"
            )
        self.config = config
        self.layer_types = check_layer_types(config)
        window = gemma3_sliding_window(config) if "sliding_attention" in self.layer_types else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, window if kind == "sliding_attention" else None)
            for i, kind in enumerate(self.layer_types)
        )
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = {
            kind: RotaryEmbedding(config, head_dim(config), self.max_positions, layer_type=kind)
            for kind in sorted(set(self.layer_types))
        }

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions) -> torch.Tensor:
        embed = self.embed_tokens(input_ids)
        hidden = embed * embedding_scale(self.config.hidden_size**0.5, embed.dtype)
        rope = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden = layer(hidden, *rope[layer.layer_type])
        return self.norm(hidden)


# ForCausalLM names (`model.` prefix) or bare backbone names (what sentence-transformers saves). Not the
# backbone's: the LM head (models/heads/lm.py reads it), a classifier's `score`, rotary buffers some
# checkpoints carry.
HEADS = r"lm_head\.|score\.|rotary_emb\."
CHECKPOINT = CheckpointNames(prefixes=("model.",), ignored=rf"^({HEADS})", packed=QKV_GATE_UP)
EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")

FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    model_class=Gemma3Model,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    embeddings=EMBEDDINGS,
)

DOCS = FamilyDocs(
    examples=("google/embeddinggemma-300m", "google/gemma-3-1b-it"),
    tested_by=tuple(f"tests/models/test_{name}.py" for name in ("gemma_parity", "gemma_embed", "gemma_parts")),
)
