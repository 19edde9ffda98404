"""BART-family encoder-decoders (BART, mBART) over a flat packed batch.

Each stack embeds tokens (times sqrt(d_model) when `scale_embedding`) plus learned positions, whose table
starts two rows in (fairseq's padding offset: position p reads row p + 2, which the input builder adds as
`position_offset`), then `layernorm_embedding`, then its layers: self-attention, (decoder) cross-attention
over the encoder output, and a feed-forward of `activation_function`, each with a residual and a LayerNorm.
BART normalizes after each residual (post-LN); mBART before each sublayer (pre-LN) and once more at the
end of each stack (`layer_norm`). Encoder and decoder read one token embedding matrix (`shared`).

`BartModel` serves BartForConditionalGeneration, BartForSequenceClassification and
MBartForConditionalGeneration checkpoints; the LM head (with `final_logits_bias`) is in heads/lm.py and the
classification head in heads/score.py (this file's FAMILY record names their tensors).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.models.interface import EncoderDecoderModel
from embedserv.models.layers import Linear, packed_linear
from embedserv.models.loading.family import QKV, CheckpointNames, Classifier, Family, FamilyDocs

# fairseq reserved the first two rows of the position table: position p is row p + 2.
POSITION_OFFSET = 2


class BartSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, layer_index: int, kind: AttentionKind) -> None:
        super().__init__()
        self.d_model = d_model
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = packed_linear(d_model, (d_model,) * 3)
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
        self.kv = packed_linear(d_model, (d_model,) * 2)
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


class BartModel(nn.Module, EncoderDecoderModel):
    """BART / mBART encoder-decoder: `forward(input_ids, positions, encoder_input_ids=..., ...) ->
    [num_decoder_tokens, d_model]`, the decoder's last norm applied. Positions come offset by 2.

    Attention layer indices: decoder self-attention 0..D-1, cross-attention D..2D-1, encoder 2D..2D+E-1.
    """

    position_offset = POSITION_OFFSET
    # The LM head's logits bias (models/heads/lm.py reads it).
    final_logits_bias = ("final_logits_bias", "model.final_logits_bias")

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.decoder_start_token_id = config.decoder_start_token_id
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        num_decoder = config.decoder_layers
        self.encoder = BartStack(
            config,
            config.encoder_layers,
            config.encoder_attention_heads,
            config.encoder_ffn_dim,
            AttentionKind.ENCODER,
            first_index=2 * num_decoder,
        )
        self.decoder = BartStack(
            config,
            num_decoder,
            config.decoder_attention_heads,
            config.decoder_ffn_dim,
            AttentionKind.DECODER,
            first_index=0,
            cross_first_index=num_decoder,
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

    def forward(self, input_ids, positions, encoder_input_ids=None, encoder_positions=None) -> torch.Tensor:
        encoder_hidden = None
        if encoder_input_ids is not None and encoder_input_ids.numel():
            if encoder_positions is None:
                raise ValueError("BART's encoder needs the positions of its inputs")
            encoder_hidden = self.encode(encoder_input_ids, encoder_positions)
        return self.decoder(self._embed(input_ids), positions, encoder_hidden)


# *ForConditionalGeneration / *ForSequenceClassification names (`model.` prefix), or bare BartModel names.
CHECKPOINT = CheckpointNames(
    prefixes=("model.",),
    # The heads (models/heads/lm.py and score.py read them).
    ignored=r"^(lm_head\.|final_logits_bias$|classification_head\.)",
    packed=(
        *QKV,
        ("encoder_attn.k_proj.", "encoder_attn.kv.", 0),
        ("encoder_attn.v_proj.", "encoder_attn.kv.", 1),
    ),
    # Token embeddings: one matrix (`shared`); many checkpoints repeat it per stack.
    renames=((r"^(encoder|decoder)\.embed_tokens\.weight$", "shared.weight"),),
)
# BartForSequenceClassification reads the decoder's last token (transformers pools the decoder state at the
# input's last EOS; fed the input shifted right, the decoder's last position holds it) through
# dense + tanh + out_proj. (MBartForSequenceClassification feeds its decoder mBART's own shift of the input,
# its last token first: not served yet.)
_CLASSIFIER = Classifier(
    token="last",
    pooler=True,
    sources={
        f"{ours}.{kind}": (f"classification_head.{theirs}.{kind}", f"model.classification_head.{theirs}.{kind}")
        for ours, theirs in (("dense", "dense"), ("out", "out_proj"))
        for kind in ("weight", "bias")
    },
)

FAMILY = Family(
    name="bart",
    model_types=("bart", "mbart"),
    model_class=BartModel,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    classifiers={"BartForSequenceClassification": _CLASSIFIER},
    embeddings=(
        "model.shared.weight",
        "shared.weight",
        "model.encoder.embed_tokens.weight",
        "encoder.embed_tokens.weight",
    ),
)

DOCS = FamilyDocs(
    examples=("facebook/bart-large-mnli", "facebook/bart-large-cnn", "facebook/mbart-large-50"),
    tested_by=tuple(
        f"tests/models/test_{name}.py"
        for name in ("seq2seq_models", "seq2seq_prefill", "seq2seq_generation", "zero_shot")
    ),
)
