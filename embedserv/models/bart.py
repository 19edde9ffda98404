"""BART-family encoder-decoders (BART, mBART) over a flat packed batch.

Each stack embeds tokens (times sqrt(d_model) when `scale_embedding`) plus learned positions, whose table
starts two rows in (fairseq's padding offset: position p reads row p + 2, which the input builder adds as
`position_offset`), then `layernorm_embedding`, then its layers: self-attention, (decoder) cross-attention
over the encoder output, and a feed-forward of `activation_function`, each with a residual and a LayerNorm.
BART normalizes after each residual (post-LN); mBART before each sublayer (pre-LN) and once more at the
end of each stack (`layer_norm`). Encoder and decoder read one token embedding matrix (`shared`).

`BartModel` serves BartForConditionalGeneration, BartForSequenceClassification and
MBartForConditionalGeneration checkpoints; the LM head (with `final_logits_bias`) is in lm_head.py and the
classification head in score_head.py.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import torch
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.models.layers import Linear, copy_checked

# fairseq reserved the first two rows of the position table: position p is row p + 2.
POSITION_OFFSET = 2


class BartSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, layer_index: int, kind: AttentionKind) -> None:
        super().__init__()
        self.d_model = d_model
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = Linear(d_model, 3 * d_model)
        self.attn = Attention(num_heads, d_model // num_heads, layer_index=layer_index, kind=kind)
        self.out_proj = Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.d_model, dim=-1)
        return self.out_proj(self.attn(q, k, v), residual=residual)


class BartCrossAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, layer_index: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.q_proj = Linear(d_model, d_model)
        # Key and value of the encoder output in one matmul; the loader stacks their weights.
        self.kv = Linear(d_model, 2 * d_model)
        self.attn = Attention(
            num_heads, d_model // num_heads, layer_index=layer_index, kind=AttentionKind.CROSS, kv_group=1
        )
        self.out_proj = Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, encoder_hidden: torch.Tensor | None) -> torch.Tensor:
        """Decoder queries over the encoder output, or over the cross cache when it is None."""
        k = v = None
        if encoder_hidden is not None:
            k, v = self.kv(encoder_hidden).split(self.d_model, dim=-1)
        return self.out_proj(self.attn(self.q_proj(x), k, v), residual=residual)


class BartLayer(nn.Module):
    """An encoder layer (no cross-attention) or a decoder layer; post-LN (BART) or pre-LN (mBART)."""

    def __init__(
        self,
        config,
        pre_norm: bool,
        num_heads: int,
        ffn_dim: int,
        self_index: int,
        kind: AttentionKind,
        cross_index: int | None = None,
    ) -> None:
        super().__init__()
        d_model = config.d_model
        self.pre_norm = pre_norm
        self.self_attn = BartSelfAttention(d_model, num_heads, self_index, kind)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        if cross_index is not None:
            self.encoder_attn = BartCrossAttention(d_model, num_heads, cross_index)
            self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        else:
            self.encoder_attn = self.encoder_attn_layer_norm = None
        self.fc1 = Linear(d_model, ffn_dim, activation=config.activation_function)
        self.fc2 = Linear(ffn_dim, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_norm:
            hidden = self.self_attn(self.self_attn_layer_norm(hidden), hidden)
            if self.encoder_attn is not None:
                hidden = self.encoder_attn(self.encoder_attn_layer_norm(hidden), hidden, encoder_hidden)
            return self.fc2(self.fc1(self.final_layer_norm(hidden)), residual=hidden)
        hidden = self.self_attn_layer_norm(self.self_attn(hidden, hidden))
        if self.encoder_attn is not None:
            hidden = self.encoder_attn_layer_norm(self.encoder_attn(hidden, hidden, encoder_hidden))
        return self.final_layer_norm(self.fc2(self.fc1(hidden), residual=hidden))


class BartStack(nn.Module):
    """The encoder or the decoder: positions, the embedding norm, layers, and mBART's final norm.

    Self-attention layers take indices `first_index`.., a decoder's cross layers `cross_first_index`..
    (None: an encoder stack, no cross-attention).
    """

    def __init__(
        self,
        config,
        num_layers: int,
        num_heads: int,
        ffn_dim: int,
        kind: AttentionKind,
        first_index: int,
        cross_first_index: int | None = None,
    ) -> None:
        super().__init__()
        pre_norm = config.model_type == "mbart"
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList(
            BartLayer(
                config,
                pre_norm,
                num_heads,
                ffn_dim,
                first_index + i,
                kind,
                None if cross_first_index is None else cross_first_index + i,
            )
            for i in range(num_layers)
        )
        self.layer_norm = nn.LayerNorm(config.d_model) if pre_norm else None

    def forward(
        self, embeddings: torch.Tensor, positions: torch.Tensor, encoder_hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`positions` already offset (row indices of the position table)."""
        hidden = self.layernorm_embedding(embeddings + self.embed_positions(positions))
        for layer in self.layers:
            hidden = layer(hidden, encoder_hidden)
        return hidden if self.layer_norm is None else self.layer_norm(hidden)


# Checkpoint names (after the `model.` prefix) of the tensors stacked into one of our parameters.
_STACKED = re.compile(
    r"^(encoder|decoder)\.layers\.(\d+)\.(self_attn\.(q|k|v)_proj|encoder_attn\.(k|v)_proj)\.(weight|bias)$"
)
# Token embeddings: one matrix (`shared`); many checkpoints repeat it per stack.
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Tensors the backbone does not hold: the heads (lm_head.py and score_head.py read them).
_IGNORED = re.compile(r"^(lm_head\.|final_logits_bias$|classification_head\.)")
_PREFIX = "model."


class BartModel(nn.Module):
    """BART / mBART encoder-decoder: `forward(input_ids, positions, encoder_input_ids=..., ...) ->
    [num_decoder_tokens, d_model]`, the decoder's last norm applied. Positions come offset by 2.

    Attention layer indices: decoder self-attention 0..D-1, cross-attention D..2D-1, encoder 2D..2D+E-1.
    """

    is_encoder_decoder = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.position_offset = POSITION_OFFSET
        self.decoder_start_token_id = config.decoder_start_token_id
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        num_decoder = config.decoder_layers
        self.encoder = BartStack(
            config, config.encoder_layers, config.encoder_attention_heads, config.encoder_ffn_dim,
            AttentionKind.ENCODER, first_index=2 * num_decoder,
        )
        self.decoder = BartStack(
            config, num_decoder, config.decoder_attention_heads, config.decoder_ffn_dim,
            AttentionKind.DECODER, first_index=0, cross_first_index=num_decoder,
        )

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.shared(input_ids)
        return embeddings * self.embed_scale if self.embed_scale != 1.0 else embeddings

    def encode(self, encoder_input_ids: torch.Tensor, encoder_positions: torch.Tensor) -> torch.Tensor:
        """[num_encoder_tokens, d_model]: the encoder output; positions offset as the decoder's."""
        return self.encoder(self._embed(encoder_input_ids), encoder_positions)

    def forward(
        self, input_ids, positions, token_type_ids=None, encoder_input_ids=None, encoder_positions=None
    ) -> torch.Tensor:
        encoder_hidden = None
        if encoder_input_ids is not None and encoder_input_ids.numel():
            if encoder_positions is None:
                raise ValueError("BART's encoder needs the positions of its inputs")
            encoder_hidden = self.encode(encoder_input_ids, encoder_positions)
        return self.decoder(self._embed(input_ids), positions, encoder_hidden)

    def _stacked_target(self, name: str) -> tuple[str, str, slice] | None:
        """(our parameter, shard label, rows) for a q/k/v projection tensor; None for any other."""
        match = _STACKED.match(name)
        if match is None:
            return None
        stack, layer, _, self_part, cross_part, kind = match.groups()
        size = self.config.d_model
        if self_part:
            index = "qkv".index(self_part)
            return f"{stack}.layers.{layer}.self_attn.qkv.{kind}", self_part, slice(index * size, (index + 1) * size)
        if stack != "decoder":
            return None
        index = "kv".index(cross_part)
        return f"decoder.layers.{layer}.encoder_attn.kv.{kind}", cross_part, slice(index * size, (index + 1) * size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors in; returns the names of our parameters it filled.

        Takes *ForConditionalGeneration / *ForSequenceClassification names (`model.` prefix) and bare
        BartModel names alike."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set[str]] = {}
        for name, tensor in weights:
            name = name.removeprefix(_PREFIX)
            if _IGNORED.match(name):
                continue
            if name in _EMBEDDINGS:
                copy_checked(params["shared.weight"].data, tensor, name)
                loaded.add("shared.weight")
                continue
            stacked = self._stacked_target(name)
            if stacked is not None:
                target, shard, rows = stacked
                if target not in params:
                    raise ValueError(f"unexpected checkpoint tensor {name!r}: this model has no {target}")
                copy_checked(params[target].data[rows], tensor, name)
                shards.setdefault(target, set()).add(shard)
                continue
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            copy_checked(params[name].data, tensor, name)
            loaded.add(name)
        # A stacked parameter is filled only when every one of its shards was.
        loaded.update(t for t, parts in shards.items() if parts == ({"k", "v"} if ".kv." in t else {"q", "k", "v"}))
        return loaded
