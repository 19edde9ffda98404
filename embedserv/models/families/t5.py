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
The LM head, and T5's d_model**-0.5 scaling of a tied head's input (`output_scale`), live in models/heads/lm.py.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.layer import Attention, AttentionKind
from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.models.families.llama import RMSNorm
from embedserv.models.interface import EncoderDecoderModel, EncoderModel
from embedserv.models.layers import Linear, get_activation, packed_linear
from embedserv.models.loading.family import CheckpointNames, Family, FamilyDocs

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
        self.qkv = packed_linear(config.d_model, (self.inner_size,) * 3, bias=False)
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
        self.kv = packed_linear(config.d_model, (self.inner_size,) * 2, bias=False)
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
            self.wi = packed_linear(config.d_model, (config.d_ff,) * 2, bias=False)
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


class T5Model(nn.Module, EncoderDecoderModel):
    """T5 / mT5 encoder-decoder: `forward(input_ids, positions, encoder_input_ids=..., ...) ->
    [num_decoder_tokens, d_model]`, the decoder's final norm applied.

    Attention layer indices: decoder self-attention 0..D-1, cross-attention D..2D-1, encoder 2D..2D+E-1.
    """

    output_scale = staticmethod(output_scale)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.decoder_start_token_id = config.decoder_start_token_id
        num_decoder = config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(
            config, config.num_layers, AttentionKind.ENCODER, first_index=2 * num_decoder, bidirectional=True
        )
        self.decoder = T5Stack(
            config,
            num_decoder,
            AttentionKind.DECODER,
            first_index=0,
            bidirectional=False,
            cross_first_index=num_decoder,
        )

    @property
    def max_positions(self) -> int:
        return _UNLIMITED_POSITIONS

    def encode(self, encoder_input_ids: torch.Tensor, encoder_positions: torch.Tensor | None = None) -> torch.Tensor:
        """[num_encoder_tokens, d_model]: the encoder output (T5 reads no positions: its bias is relative)."""
        return self.encoder(self.shared(encoder_input_ids))

    def forward(self, input_ids, positions, encoder_input_ids=None, encoder_positions=None) -> torch.Tensor:
        encoder_hidden = None
        if encoder_input_ids is not None and encoder_input_ids.numel():
            encoder_hidden = self.encode(encoder_input_ids, encoder_positions)
        return self.decoder(self.shared(input_ids), encoder_hidden)


class T5EncoderModel(nn.Module, EncoderModel):
    """The T5 / mT5 encoder alone: `forward(input_ids, positions) -> [num_tokens, d_model]`, final norm applied.

    Its attention layers are plain self-attention (kind DECODER, KV group 0) whose metadata, as for any
    encoder-only model, is bidirectional; they add the encoder's bidirectional relative bias.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, config.num_layers, AttentionKind.DECODER, first_index=0, bidirectional=True)

    @property
    def max_positions(self) -> int:
        return _UNLIMITED_POSITIONS

    def forward(self, input_ids, positions) -> torch.Tensor:
        return self.encoder(self.shared(input_ids))


def _stack_renames(stack: str, mlp_layer: int) -> tuple[tuple[str, str], ...]:
    """One stack's block names -> ours; the feed-forward block is layer.1 in the encoder, layer.2 in the
    decoder (after cross-attention, layer.1)."""
    block = rf"^{stack}\.block\.(\d+)\.layer"
    bias = rf"^{stack}\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\."
    return (
        (bias, f"{stack}.relative_bias.relative_attention_bias."),
        (rf"{block}\.0\.layer_norm\.", rf"{stack}.layers.\1.self_attn_norm."),
        (rf"{block}\.0\.SelfAttention\.", rf"{stack}.layers.\1.self_attn."),
        (rf"{block}\.{mlp_layer}\.layer_norm\.", rf"{stack}.layers.\1.mlp_norm."),
        (rf"{block}\.{mlp_layer}\.DenseReluDense\.", rf"{stack}.layers.\1.mlp."),
        (rf"^{stack}\.final_layer_norm\.", f"{stack}.final_norm."),
    )


# Token embeddings: one matrix (`shared`); older checkpoints repeat it per stack.
_SHARED = (r"^(encoder|decoder)\.embed_tokens\.weight$", "shared.weight")
_PACKED = (
    ("SelfAttention.q.", "SelfAttention.qkv.", 0),
    ("SelfAttention.k.", "SelfAttention.qkv.", 1),
    ("SelfAttention.v.", "SelfAttention.qkv.", 2),
    ("EncDecAttention.k.", "EncDecAttention.kv.", 0),
    ("EncDecAttention.v.", "EncDecAttention.kv.", 1),
    ("DenseReluDense.wi_0.", "DenseReluDense.wi.", 0),
    ("DenseReluDense.wi_1.", "DenseReluDense.wi.", 1),
)
CHECKPOINT = CheckpointNames(
    # The LM head is models/heads/lm.py's; transformers ignores the cross-attention bias some checkpoints
    # carry (cross-attention takes none).
    ignored=r"^(lm_head\.|decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.)",
    packed=_PACKED,
    renames=(
        _SHARED,
        *_stack_renames("encoder", mlp_layer=1),
        (r"^decoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"decoder.layers.\1.cross_attn_norm."),
        (r"^decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.", r"decoder.layers.\1.cross_attn."),
        *_stack_renames("decoder", mlp_layer=2),
    ),
)
# The encoder alone skips a full checkpoint's decoder and LM head.
ENCODER_CHECKPOINT = CheckpointNames(
    ignored=r"^(decoder\.|lm_head\.)", packed=_PACKED, renames=(_SHARED, *_stack_renames("encoder", mlp_layer=1))
)

FAMILY = Family(
    name="t5",
    model_types=("t5", "mt5"),
    model_class=T5Model,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    embeddings=("shared.weight", "encoder.embed_tokens.weight"),
)

DOCS = FamilyDocs(
    examples=(
        "sentence-transformers/sentence-t5-base",
        "sentence-transformers/gtr-t5-base",
        "castorini/monot5-base-msmarco",
        "google/flan-t5-base",
    ),
    tested_by=tuple(
        f"tests/models/test_{name}.py" for name in ("seq2seq_models", "seq2seq_prefill", "seq2seq_generation")
    ),
)
# T5 checkpoints served by their encoder alone (models/registry.py decides which).
ENCODER_FAMILY = Family(
    name="t5-encoder",
    model_types=("t5", "mt5"),
    model_class=T5EncoderModel,
    checkpoint=ENCODER_CHECKPOINT,
    is_encoder=True,
    embeddings=("shared.weight", "encoder.embed_tokens.weight"),
)
