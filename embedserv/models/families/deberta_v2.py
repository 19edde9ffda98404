"""DeBERTa-v2 / v3 encoders over a flat packed batch: BERT's post-norm blocks with disentangled attention.

Each layer scores queries and keys as BERT does, plus the query against a position key and the key
against a position query of their relative position (c2p and p2c, as `pos_att_type` says), all scaled by
1 / sqrt(head_size * (1 + number of those terms)). The positions are rows of one model-wide table of
relative embeddings ([2 * span, hidden], LayerNorm'd when `norm_rel_ebd` says so), indexed by the
(log-bucketed, with `position_buckets`) distance; every layer projects the table through its own key and
query projections (`share_att_key`, v3) or through separate pos_key / pos_query ones (v2), and the
attention backends turn those projections into each sequence's bias (attention/disentangled.py).

v3 has no absolute positions (`position_biased_input` false) and no token types; v2 xlarge checkpoints
may have both. What transformers runs and we do not (the first layer's ConvLayer, `conv_kernel_size`;
pos_att_type terms other than c2p and p2c) is refused at start-up. DeBERTa v1 (`deberta`) is another
model type.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.disentangled import DisentangledPositions, PositionProjections
from embedserv.attention.layer import Attention, AttentionKind
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear, packed_linear
from embedserv.models.loading.family import TOKEN_CLASSIFIER, CheckpointNames, Classifier, Family, FamilyDocs

_TERMS = ("c2p", "p2c")


def _pos_att_type(config) -> tuple[str, ...]:
    terms = config.pos_att_type or []
    if isinstance(terms, str):  # transformers splits "p2c|c2p" itself; configs may hold either form
        terms = terms.lower().split("|")
    terms = tuple(term.strip() for term in terms)
    unknown = [term for term in terms if term not in _TERMS]
    if unknown:
        raise ValueError(f"pos_att_type {'|'.join(unknown)} is not served (DeBERTa-v2 scores c2p and p2c)")
    return terms


class DebertaV2Embeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size = getattr(config, "embedding_size", None) or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, size) if config.position_biased_input else None
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size) if config.type_vocab_size > 0 else None
        # Embeddings narrower than the hidden states (some v2 checkpoints) are projected up before the norm.
        self.embed_proj = Linear(size, config.hidden_size, bias=False) if size != config.hidden_size else None
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                hidden = hidden + self.token_type_embeddings.weight[0]
            else:
                hidden = hidden + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            hidden = self.embed_proj(hidden)
        return self.norm(hidden)


class DebertaV2Layer(nn.Module):
    def __init__(self, config, layer_index: int, disentangled: DisentangledPositions | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.hidden_size = hidden
        # transformers scales by every listed term, even with relative attention off (then it adds none).
        listed = _pos_att_type(config)
        self.terms = listed if disentangled is not None else ()
        if not self.terms:
            # Relative attention with no term to score is plain attention (transformers adds nothing).
            disentangled = None
        self.share_att_key = bool(getattr(config, "share_att_key", False))
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = packed_linear(hidden, (hidden,) * 3)
        # v2 projects the relative embeddings through projections of their own; v3 shares q's and k's.
        separate = not self.share_att_key
        self.pos_key_proj = Linear(hidden, hidden) if separate and "c2p" in self.terms else None
        self.pos_query_proj = Linear(hidden, hidden) if separate and "p2c" in self.terms else None
        head_size = hidden // num_heads
        self.attn = Attention(
            num_heads,
            head_size,
            scale=(head_size * (1 + len(listed))) ** -0.5,
            layer_index=layer_index,
            kind=AttentionKind.ENCODER,
            disentangled=disentangled,
        )
        self.attn_out = Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_in = Linear(hidden, config.intermediate_size, activation=config.hidden_act)
        self.ffn_out = Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def position_projections(self, relative: torch.Tensor | None) -> PositionProjections | None:
        """The layer's projections of the relative embeddings [2 * span, hidden] (None: no term to score)."""
        if self.attn.disentangled is None:
            return None
        if self.share_att_key:
            pos_query, pos_key, _ = self.qkv(relative).split(self.hidden_size, dim=-1)
        else:
            pos_key = self.pos_key_proj(relative) if self.pos_key_proj is not None else None
            pos_query = self.pos_query_proj(relative) if self.pos_query_proj is not None else None
        return PositionProjections(
            keys=pos_key if "c2p" in self.terms else None, queries=pos_query if "p2c" in self.terms else None
        )

    def forward(self, hidden: torch.Tensor, relative: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(hidden).split(self.hidden_size, dim=-1)
        attended = self.attn(q, k, v, self.position_projections(relative))
        hidden = self.attn_norm(self.attn_out(attended, residual=hidden))
        return self.ffn_norm(self.ffn_out(self.ffn_in(hidden), residual=hidden))


class DebertaV2Model(nn.Module, EncoderModel):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

    reads_token_types = True

    # For docs/models_table.py: published DeBERTa models add a score bias (the default config, which it
    # builds, has relative attention off), so the bias-free kernels cannot run them.
    score_bias = True

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "conv_kernel_size", 0) > 0:
            raise ValueError("conv_kernel_size > 0 (DeBERTa-v2's ConvLayer after the first layer) is not supported")
        if getattr(config, "pooler_hidden_size", config.hidden_size) != config.hidden_size:
            raise ValueError("a pooler_hidden_size other than hidden_size is not supported")
        head_size = config.hidden_size // config.num_attention_heads
        if (
            config.hidden_size % config.num_attention_heads
            or getattr(config, "attention_head_size", head_size) != head_size
        ):
            # transformers' attention output projection is hidden_size wide: heads * head size must be that.
            raise ValueError(
                f"hidden_size {config.hidden_size} is not {config.num_attention_heads} heads of attention_head_size"
            )
        self.config = config
        # Absolute positions (v2's, when position_biased_input) count from 0.
        self.embeddings = DebertaV2Embeddings(config)
        disentangled = None
        if config.relative_attention:
            max_relative = config.max_relative_positions
            if max_relative < 1:
                max_relative = config.max_position_embeddings
            disentangled = DisentangledPositions(getattr(config, "position_buckets", -1), max_relative)
            self.rel_embeddings = nn.Embedding(2 * disentangled.span, config.hidden_size)
            norm_rel = [part.strip() for part in str(getattr(config, "norm_rel_ebd", "none")).lower().split("|")]
            self.rel_norm = (
                nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if "layer_norm" in norm_rel else None
            )
        self.layers = nn.ModuleList(DebertaV2Layer(config, i, disentangled) for i in range(config.num_hidden_layers))

    @property
    def max_positions(self) -> int:
        # v3 has no absolute positions, but its tokenizer and training stop there too.
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        relative = None
        if self.config.relative_attention:
            relative = self.rel_embeddings.weight
            if self.rel_norm is not None:
                relative = self.rel_norm(relative)
        for layer in self.layers:
            hidden = layer(hidden, relative)
        return hidden


def checkpoint_names(config) -> CheckpointNames:
    """DebertaV2Model / *ForSequenceClassification / *ForMaskedLM names (under `deberta.`), or bare. A
    checkpoint without absolute positions may still carry their table, which transformers drops too."""
    ignored = r"^(pooler\.|classifier\.|cls\.|lm_predictions\.|mask_predictions\.|embeddings\.position_ids)"
    if not config.position_biased_input:
        ignored += r"|^embeddings\.position_embeddings\."
    return CheckpointNames(
        prefixes=("deberta.",),
        ignored=ignored,
        packed=tuple(
            (f"attention.self.{part}_proj.", "attention.self.qkv.", index)
            for index, part in enumerate(("query", "key", "value"))
        ),
        renames=(
            (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
            (r"^encoder\.rel_embeddings\.", "rel_embeddings."),
            (r"^encoder\.LayerNorm\.", "rel_norm."),
            (r"^encoder\.layer\.(\d+)\.attention\.self\.qkv\.", r"layers.\1.qkv."),
            (r"^encoder\.layer\.(\d+)\.attention\.self\.(pos_key_proj|pos_query_proj)\.", r"layers.\1.\2."),
            (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out."),
            (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
            (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
            (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
            (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
        ),
    )


# ContextPooler: the first token through dense + pooler_hidden_act, then the classifier.
_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    activation=lambda config: config.pooler_hidden_act,
    sources={
        "dense.weight": ("pooler.dense.weight",),
        "dense.bias": ("pooler.dense.bias",),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
)

FAMILY = Family(
    name="deberta-v2",
    model_types=("deberta-v2",),
    model_class=DebertaV2Model,
    checkpoint=checkpoint_names,
    is_encoder=True,
    classifiers={"DebertaV2ForSequenceClassification": _CLASSIFIER},
    token_classifiers={"DebertaV2ForTokenClassification": TOKEN_CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=(
        "mixedbread-ai/mxbai-rerank-base-v1",
        "mixedbread-ai/mxbai-rerank-large-v1",
        "MoritzLaurer/DeBERTa-v3-base-mnli-fever-anli",
        "MoritzLaurer/DeBERTa-v3-large-mnli-fever-anli-ling-wanli",
        "cross-encoder/nli-deberta-v3-base",
    ),
    tested_by=(
        "tests/models/test_deberta_parity.py",
        "tests/attention/test_disentangled.py",
        "tests/models/test_token_classify_parity.py",
    ),
)
