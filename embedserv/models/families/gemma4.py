"""Gemma 4 text decoders (Gemma4ForCausalLM, Gemma4TextModel) over a flat packed batch.

Gemma 3's block (gemma.py) with these changes, each as transformers' modeling_gemma4 has it:
- RMSNorm scales by its weight (not 1 + weight); values are RMS-normed too, without a scale;
- attention is unscaled (scale 1.0: the q/k norms set the score scale);
- full layers may have their own head size and KV heads (`per_layer_config`, from `global_head_dim`),
  their own rotary settings ("proportional": only part of each head rotates), and with
  `attention_k_eq_v` no value projection: values are the raw key projection;
- per-layer inputs (PLE): a second token embedding plus a projection of the embeddings give each layer
  a small vector that gates a residual branch after the MLP; each layer's output is scaled by its
  `layer_scalar`;
- KV sharing: the last `num_kv_shared_layers` layers compute no keys and values; each reads those of the
  last earlier non-shared layer of its type (`kv_source_layer`), owns no cache, and (with
  `use_double_wide_mlp`) has an MLP twice as wide.
The model's first shared layer is its `prefill_skip_layer`: with --kv-sharing-fast-prefill the layers
from there on run only the rows whose output is read (the runner passes them as `prefill_skip_rows`).
MoE configs (`enable_moe_block`) are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.layer import Attention, link_kv_sharing
from embedserv.models.families.gemma import EMBEDDINGS, HEADS, GemmaMLP, check_layer_types, embedding_scale
from embedserv.models.interface import DecoderModel
from embedserv.models.layers import Linear, get_activation, packed_linear
from embedserv.models.loading.family import QKV_GATE_UP, CheckpointNames, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding, apply_rotary


def gemma4_sliding_window(config) -> int:
    """W of Gemma 4's sliding layers (a query at p sees the key at j only when |p - j| < W, and j <= p
    when causal).

    Causal (also `use_bidirectional_attention: "vision"`, where text stays causal): transformers' sliding
    mask keeps `kv > q - sliding_window`, so W = sliding_window. "all": the config halves the window when
    it loads (`sliding_window // 2 + 1`, the value read here) and the mask is
    `sliding_window_bidirectional_overlay`, `|q - kv| <= sliding_window`: W = sliding_window + 1.
    """
    if config.use_bidirectional_attention == "all":
        return int(config.sliding_window) + 1
    return int(config.sliding_window)


def kv_sources(config) -> list[int | None]:
    """Per layer, the layer whose keys and values it reads (None: its own), as transformers'
    `kv_sharing_modes` pairs them: the last non-shared layer of the same type."""
    types = config.layer_types
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    sources: list[int | None] = [None] * config.num_hidden_layers
    for i in range(first_shared, config.num_hidden_layers):
        earlier = [j for j in range(first_shared) if types[j] == types[i]]
        if not earlier:
            raise ValueError(
                f"shared layer {i} ({types[i]}) has no earlier {types[i]} layer to read keys and values from"
            )
        sources[i] = earlier[-1]
    return sources


class Gemma4RMSNorm(nn.Module):
    """As transformers' Gemma4RMSNorm: float32, `pow(mean square + eps, -0.5)`, times the weight if any."""

    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.pow(out.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_index: int, sliding_window: int | None, kv_source: int | None):
        super().__init__()
        layer_config = config.per_layer_config[layer_index]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = layer_config.num_key_value_heads
        self.head_dim = layer_config.head_dim
        self.shared = kv_source is not None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.shared:
            self.sizes: tuple[int, ...] = (q_size,)
        elif config.attention_k_eq_v and config.layer_types[layer_index] == "full_attention":
            self.sizes = (q_size, kv_size)  # values are the raw key projection
        else:
            self.sizes = (q_size, kv_size, kv_size)
        self.qkv = packed_linear(config.hidden_size, self.sizes, bias=config.attention_bias)
        eps = config.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.k_norm = None if self.shared else Gemma4RMSNorm(self.head_dim, eps)
        self.v_norm = None if self.shared else Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale=1.0,
            num_kv_heads=self.num_kv_heads,
            layer_index=layer_index,
            kv_source_layer=kv_source,
            sliding_window=sliding_window,
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        parts = self.qkv(x).split(self.sizes, dim=-1)
        q = apply_rotary(self.q_norm(parts[0].view(-1, self.num_heads, self.head_dim)), cos, sin).flatten(1)
        k = v = None
        if not self.shared:
            keys = parts[1].view(-1, self.num_kv_heads, self.head_dim)
            values = parts[2].view(-1, self.num_kv_heads, self.head_dim) if len(parts) == 3 else keys
            k = apply_rotary(self.k_norm(keys), cos, sin).flatten(1)
            v = self.v_norm(values).flatten(1)
        return self.o_proj(self.attn(q, k, v))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, sliding_window: int | None, kv_source: int | None):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.layer_type = config.layer_types[layer_index]
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, layer_index, sliding_window, kv_source)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        wide = 2 if config.use_double_wide_mlp and kv_source is not None else 1
        self.mlp = GemmaMLP(hidden, wide * config.intermediate_size, config.hidden_activation)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        per_layer = config.hidden_size_per_layer_input
        if per_layer:
            self.per_layer_input_gate = Linear(hidden, per_layer, bias=False)
            self.act = get_activation(config.hidden_activation)
            self.per_layer_projection = Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        else:
            self.per_layer_input_gate = None
        # A buffer, not a parameter: checkpoints that lack it keep transformers' initial 1 (Gemma4Model.fill_defaults).
        self.register_buffer("layer_scalar", torch.empty(1))

    def forward(self, hidden: torch.Tensor, per_layer_input: torch.Tensor | None, cos, sin) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.per_layer_input_gate is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4Model(nn.Module, DecoderModel):
    """`forward(input_ids, positions[, prefill_skip_rows]) -> [num_tokens, hidden]`, final
    norm applied; with `prefill_skip_rows` ([num_kept] int64, indices into the packed tokens), the layers
    from `prefill_skip_layer` on run only those rows, and so do the returned states."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.enable_moe_block:
            raise ValueError("MoE Gemma 4 (enable_moe_block) is not supported; serve a dense Gemma 4 model")
        self.config = config
        types = check_layer_types(config)
        window = gemma4_sliding_window(config)
        sources = kv_sources(config)
        # The first shared layer: the prefill skip starts there.
        shared = [i for i, source in enumerate(sources) if source is not None]
        self.prefill_skip_layer: int | None = shared[0] if shared else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.per_layer_size = config.hidden_size_per_layer_input or 0
        if self.per_layer_size:
            total = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = Linear(config.hidden_size, total, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, window if kind == "sliding_attention" else None, sources[i])
            for i, kind in enumerate(types)
        )
        link_kv_sharing([layer.self_attn.attn for layer in self.layers])
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = {
            kind: RotaryEmbedding(config, config.per_layer_config[kind].head_dim, self.max_positions, layer_type=kind)
            for kind in sorted(set(types))
        }

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def fill_defaults(self) -> None:
        """Checkpoints that lack the layer scalars keep transformers' initial 1."""
        for layer in self.layers:
            layer.layer_scalar.fill_(1.0)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[num_tokens, layers, per_layer_size]: token identity plus a projection of the embeddings."""
        shape = (-1, self.config.num_hidden_layers, self.per_layer_size)
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = (tokens * embedding_scale(self.per_layer_size**0.5, tokens.dtype)).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + tokens) * 2.0**-0.5

    def forward(self, input_ids, positions, prefill_skip_rows=None) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        hidden = embeds * embedding_scale(self.config.hidden_size**0.5, embeds.dtype)
        per_layer = self._per_layer_inputs(input_ids, hidden) if self.per_layer_size else None
        rope = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            if i == self.prefill_skip_layer and prefill_skip_rows is not None:
                # The shared layers change no cache: only the rows whose output is read run on.
                hidden, per_layer, rope = _keep(prefill_skip_rows, hidden, per_layer, rope)
            hidden = layer(hidden, per_layer[:, i] if per_layer is not None else None, *rope[layer.layer_type])
        return self.norm(hidden)


def _keep(rows: torch.Tensor, hidden: torch.Tensor, per_layer: torch.Tensor | None, rope: dict):
    """The hidden states, per-layer inputs and every layer type's cos/sin of `rows` only."""
    per_layer = per_layer.index_select(0, rows) if per_layer is not None else None
    rope = {kind: (cos.index_select(0, rows), sin.index_select(0, rows)) for kind, (cos, sin) in rope.items()}
    return hidden.index_select(0, rows), per_layer, rope


def checkpoint_names(config) -> CheckpointNames:
    """Gemma 3's names; transformers also drops shared layers' key/value projections and norms on load."""
    shared = [str(i) for i, source in enumerate(kv_sources(config)) if source is not None]
    shared_kv = rf"|layers\.({'|'.join(shared)})\.self_attn\.(k|v)_(proj|norm)\." if shared else ""
    return CheckpointNames(prefixes=("model.",), ignored=rf"^({HEADS}{shared_kv})", packed=QKV_GATE_UP)


FAMILY = Family(
    name="gemma4",
    model_types=("gemma4_text",),
    model_class=Gemma4Model,
    checkpoint=checkpoint_names,
    is_encoder=False,
    embeddings=EMBEDDINGS,
)

DOCS = FamilyDocs(
    tested_by=tuple(
        f"tests/models/test_{name}.py" for name in ("gemma_parity", "gemma_embed", "gemma_parts", "kv_sharing")
    ),
)
