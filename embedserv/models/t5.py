"""T5-family encoder-decoders (T5 v1.0, v1.1 / Flan-T5, mT5) and T5 encoders over a flat packed batch.

Pre-norm blocks of RMSNorm (T5's "layer norm": no mean, no bias, in float32) -> attention -> RMSNorm ->
feed-forward. No position embeddings: each stack's first self-attention layer learns a relative position
bias by bucketed distance that every self-attention layer of the stack adds (one RelativePositionBias per
stack, which the attention backends apply). Scores are not scaled (the scale is folded into the query
weights at training). The members differ in the feed-forward: v1.0 `relu(x wi) wo`, v1.1 and mT5 a gated
`gelu_tanh(x wi_0) * (x wi_1) wo`, as `feed_forward_proj` says.

`T5Model` serves *ForConditionalGeneration checkpoints: `forward` runs the encoder over the step's encoder
inputs (when there are any) and the decoder over the decoder tokens, whose cross-attention reads the
encoder output (or, on later generation steps, the cross KV cache). `T5EncoderModel` is the encoder alone
(sentence-T5, GTR, T5EncoderModel checkpoints); given a full checkpoint it skips the decoder's tensors.
The LM head, and T5's d_model**-0.5 scaling of a tied head's input, live in lm_head.py.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.models.layers import Linear, copy_checked, get_activation
from embedserv.models.llama import RMSNorm

# T5 has no position limit; the tokenizer's model_max_length bounds inputs.
_UNLIMITED_POSITIONS = 1 << 20


def feed_forward(config) -> tuple[str, bool]:
    """(activation, gated) from `feed_forward_proj`: "relu" -> relu; "gated-gelu" -> gelu_new (tanh) gated."""
    parts = str(getattr(config, "feed_forward_proj", "relu")).split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(f"feed_forward_proj {config.feed_forward_proj!r} is not 'ACT' or 'gated-ACT'")
    activation = "gelu_new" if parts == ["gated", "gelu"] else parts[-1]
    get_activation(activation)  # refuses an unknown one now, by name
    return activation, len(parts) == 2


def output_scale(hf_config) -> float:
    """What a T5 LM head multiplies the decoder output by: d_model**-0.5 when the head is the embedding matrix
    by the config (T5 v1.0), else 1.

    transformers 5 records it as `scale_decoder_outputs` (config.json's tie_word_embeddings, true when
    absent; v1.1 / Flan-T5 say false); transformers 4 read tie_word_embeddings itself. mT5 never scales in
    transformers 5.
    """
    if hf_config.model_type != "t5":
        return 1.0
    scale = getattr(hf_config, "scale_decoder_outputs", None)
    if scale is None:
        scale = getattr(hf_config, "tie_word_embeddings", True)
    return hf_config.d_model**-0.5 if scale else 1.0


class T5SelfAttention(nn.Module):
    def __init__(self, config, layer_index: int, kind: AttentionKind, relative_bias: RelativePositionBias) -> None:
        super().__init__()
        self.inner_size = config.num_heads * config.d_kv
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = Linear(config.d_model, 3 * self.inner_size, bias=False)
        self.attn = Attention(
            config.num_heads, config.d_kv, scale=1.0, layer_index=layer_index, kind=kind, relative_bias=relative_bias
        )
        self.o = Linear(self.inner_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention of the normed `x`, plus `residual` (fused into the output projection)."""
        q, k, v = self.qkv(x).split(self.inner_size, dim=-1)
        return self.o(self.attn(q, k, v), residual=residual)


class T5CrossAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.inner_size = config.num_heads * config.d_kv
        self.q = Linear(config.d_model, self.inner_size, bias=False)
        # Key and value of the encoder output in one matmul; the loader stacks their weights.
        self.kv = Linear(config.d_model, 2 * self.inner_size, bias=False)
        self.attn = Attention(
            config.num_heads, config.d_kv, scale=1.0, layer_index=layer_index, kind=AttentionKind.CROSS, kv_group=1
        )
        self.o = Linear(self.inner_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        """Decoder queries (normed `x`) over the encoder output, or over the cross cache when it is None."""
        k = v = None
        if encoder_hidden is not None:
            k, v = self.kv(encoder_hidden).split(self.inner_size, dim=-1)
        return self.o(self.attn(self.q(x), k, v), residual=residual)


class T5FeedForward(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        activation, self.gated = feed_forward(config)
        if self.gated:
            # wi_0 (through the activation) and wi_1 in one matmul; the loader stacks their weights.
            self.wi = Linear(config.d_model, 2 * config.d_ff, bias=False)
            self.act = get_activation(activation)
        else:
            self.wi = Linear(config.d_model, config.d_ff, bias=False, activation=activation)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden = self.wi(x)
        if self.gated:
            gate, linear = hidden.chunk(2, dim=-1)
            hidden = self.act(gate) * linear
        return self.wo(hidden, residual=residual)


class T5Layer(nn.Module):
    """One block: self-attention, cross-attention (decoder stacks only), feed-forward; each pre-normed."""

    def __init__(
        self,
        config,
        self_index: int,
        kind: AttentionKind,
        relative_bias: RelativePositionBias,
        cross_index: int | None = None,
    ) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.self_attn_norm = RMSNorm(config.d_model, eps)
        self.self_attn = T5SelfAttention(config, self_index, kind, relative_bias)
        if cross_index is not None:
            self.cross_attn_norm = RMSNorm(config.d_model, eps)
            self.cross_attn = T5CrossAttention(config, cross_index)
        else:
            self.cross_attn_norm = self.cross_attn = None
        self.mlp_norm = RMSNorm(config.d_model, eps)
        self.mlp = T5FeedForward(config)

    def forward(self, hidden: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.self_attn(self.self_attn_norm(hidden), hidden)
        if self.cross_attn is not None:
            hidden = self.cross_attn(self.cross_attn_norm(hidden), hidden, encoder_hidden)
        return self.mlp(self.mlp_norm(hidden), hidden)


class T5Stack(nn.Module):
    """The encoder or the decoder: layers over embedded tokens, then the final norm.

    Self-attention layers take indices `first_index`.., a decoder's cross layers `cross_first_index`..
    (None: an encoder stack, no cross-attention).
    """

    def __init__(
        self,
        config,
        num_layers: int,
        kind: AttentionKind,
        first_index: int,
        bidirectional: bool,
        cross_first_index: int | None = None,
    ) -> None:
        super().__init__()
        # One bias table for the stack: checkpoints keep it in the first block's self-attention.
        self.relative_bias = RelativePositionBias(
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
            config.num_heads,
            bidirectional,
        )
        self.layers = nn.ModuleList(
            T5Layer(
                config,
                first_index + i,
                kind,
                self.relative_bias,
                None if cross_first_index is None else cross_first_index + i,
            )
            for i in range(num_layers)
        )
        self.final_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, hidden: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, encoder_hidden)
        return self.final_norm(hidden)


# Checkpoint names -> ours, after the `encoder.` / `decoder.` stack prefix (stacked projections are separate).
_RENAMES = [
    (r"^block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.", "relative_bias.relative_attention_bias."),
    (r"^block\.(\d+)\.layer\.0\.layer_norm\.", r"layers.\1.self_attn_norm."),
    (r"^block\.(\d+)\.layer\.0\.SelfAttention\.o\.", r"layers.\1.self_attn.o."),
    (r"^final_layer_norm\.", "final_norm."),
]
# The feed-forward block and its norm are layer.1 in the encoder, layer.2 in the decoder (after cross).
_ENCODER_RENAMES = [
    (r"^block\.(\d+)\.layer\.1\.layer_norm\.", r"layers.\1.mlp_norm."),
    (r"^block\.(\d+)\.layer\.1\.DenseReluDense\.(wi|wo)\.", r"layers.\1.mlp.\2."),
]
_DECODER_RENAMES = [
    (r"^block\.(\d+)\.layer\.1\.layer_norm\.", r"layers.\1.cross_attn_norm."),
    (r"^block\.(\d+)\.layer\.1\.EncDecAttention\.(q|o)\.", r"layers.\1.cross_attn.\2."),
    (r"^block\.(\d+)\.layer\.2\.layer_norm\.", r"layers.\1.mlp_norm."),
    (r"^block\.(\d+)\.layer\.2\.DenseReluDense\.(wi|wo)\.", r"layers.\1.mlp.\2."),
]
# (stack-relative name) -> (our stacked parameter, shard, index of the shard in it).
_STACKED = [
    (re.compile(r"^block\.(\d+)\.layer\.0\.SelfAttention\.(q|k|v)\.weight$"), "layers.{}.self_attn.qkv.weight", "qkv"),
    (re.compile(r"^block\.(\d+)\.layer\.1\.EncDecAttention\.(k|v)\.weight$"), "layers.{}.cross_attn.kv.weight", "kv"),
    (re.compile(r"^block\.(\d+)\.layer\.[12]\.DenseReluDense\.(wi_0|wi_1)\.weight$"), "layers.{}.mlp.wi.weight", "wi"),
]
_SHARDS = {"qkv": ("q", "k", "v"), "kv": ("k", "v"), "wi": ("wi_0", "wi_1")}
# Token embeddings: one matrix (`shared`); older checkpoints repeat it per stack.
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# transformers ignores the cross-attention bias some checkpoints carry (cross-attention takes none).
_UNUSED = re.compile(r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.")


class _T5Loader:
    """Checkpoint names -> our parameters, for the stacks a model has; `load` returns what it filled."""

    def __init__(self, model: nn.Module, stacks: tuple[str, ...], ignored: re.Pattern) -> None:
        self.params = dict(model.named_parameters())
        self.stacks = stacks
        self.ignored = ignored

    def _rename(self, stack: str, name: str) -> str:
        for pattern, replacement in _RENAMES + (_DECODER_RENAMES if stack == "decoder" else _ENCODER_RENAMES):
            name = re.sub(pattern, replacement, name)
        return f"{stack}.{name}"

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        shards: dict[str, set[str]] = {}
        for name, tensor in weights:
            if self.ignored.match(name) or _UNUSED.match(name):
                continue
            if name in _EMBEDDINGS:
                copy_checked(self.params["shared.weight"].data, tensor, name)
                loaded.add("shared.weight")
                continue
            stack, _, rest = name.partition(".")
            if stack not in self.stacks:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            stacked = self._stacked_target(stack, rest)
            if stacked is not None:
                target, shard, index = stacked
                if target not in self.params:
                    raise ValueError(f"unexpected checkpoint tensor {name!r}: this model has no {target}")
                rows = self.params[target].shape[0] // len(_SHARDS[shard[0]])
                copy_checked(self.params[target].data[index * rows : (index + 1) * rows], tensor, name)
                shards.setdefault(target, set()).add(shard[1])
                continue
            ours = self._rename(stack, rest)
            if ours not in self.params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            copy_checked(self.params[ours].data, tensor, name)
            loaded.add(ours)
        # A stacked parameter is filled only when every one of its shards was.
        for target, parts in shards.items():
            kind = target.rsplit(".", 2)[-2]
            if parts == set(_SHARDS[kind]):
                loaded.add(target)
        return loaded

    def _stacked_target(self, stack: str, name: str) -> tuple[str, tuple[str, str], int] | None:
        for pattern, template, kind in _STACKED:
            match = pattern.match(name)
            if match is not None:
                layer, part = match.groups()
                return f"{stack}.{template.format(layer)}", (kind, part), _SHARDS[kind].index(part)
        return None


class T5Model(nn.Module):
    """T5 / mT5 encoder-decoder: `forward(input_ids, positions, encoder_input_ids=..., ...) ->
    [num_decoder_tokens, d_model]`, the decoder's final norm applied.

    Attention layer indices: decoder self-attention 0..D-1, cross-attention D..2D-1, encoder 2D..2D+E-1.
    """

    is_encoder_decoder = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.position_offset = 0
        self.decoder_start_token_id = config.decoder_start_token_id
        num_decoder = config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(
            config, config.num_layers, AttentionKind.ENCODER, first_index=2 * num_decoder, bidirectional=True
        )
        self.decoder = T5Stack(
            config, num_decoder, AttentionKind.DECODER, first_index=0, bidirectional=False,
            cross_first_index=num_decoder,
        )

    @property
    def max_positions(self) -> int:
        return _UNLIMITED_POSITIONS

    def encode(self, encoder_input_ids: torch.Tensor, encoder_positions: torch.Tensor | None = None) -> torch.Tensor:
        """[num_encoder_tokens, d_model]: the encoder output (T5 reads no positions: its bias is relative)."""
        return self.encoder(self.shared(encoder_input_ids))

    def forward(
        self, input_ids, positions, token_type_ids=None, encoder_input_ids=None, encoder_positions=None
    ) -> torch.Tensor:
        encoder_hidden = None
        if encoder_input_ids is not None and encoder_input_ids.numel():
            encoder_hidden = self.encode(encoder_input_ids, encoder_positions)
        return self.decoder(self.shared(input_ids), encoder_hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors in; returns the names of our parameters it filled. The LM head
        (lm_head.weight) is not the backbone's: lm_head.py reads it."""
        return _T5Loader(self, ("encoder", "decoder"), re.compile(r"^lm_head\.")).load(weights)


class T5EncoderModel(nn.Module):
    """The T5 / mT5 encoder alone: `forward(input_ids, positions) -> [num_tokens, d_model]`, final norm applied.

    Its attention layers are plain self-attention (kind DECODER, KV group 0) whose metadata, as for any
    encoder-only model, is bidirectional; they add the encoder's bidirectional relative bias.
    """

    is_encoder_decoder = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.position_offset = 0
        self.decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, config.num_layers, AttentionKind.DECODER, first_index=0, bidirectional=True)

    @property
    def max_positions(self) -> int:
        return _UNLIMITED_POSITIONS

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        return self.encoder(self.shared(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies the encoder's tensors in (a full T5 checkpoint's decoder and LM head are skipped)."""
        return _T5Loader(self, ("encoder",), re.compile(r"^(decoder\.|lm_head\.)")).load(weights)
