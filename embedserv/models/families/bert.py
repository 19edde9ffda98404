"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over a flat packed batch.

The three share one architecture; they differ only in where positions start: BERT counts from 0,
RoBERTa and XLM-R from `pad_token_id + 1` (their checkpoints reserve the first rows for padding).
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear, packed_linear
from embedserv.models.loading.family import (
    TOKEN_CLASSIFIER,
    CheckpointNames,
    Classifier,
    Family,
    FamilyDocs,
    MlmHeadNames,
)

# RoBERTa-style model types, whose positions start after the padding index.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


class BertEmbeddings(nn.Module):
    # `size`: the embedding width where it differs from hidden_size (ELECTRA's embedding_size).
    def __init__(self, config, size: int | None = None) -> None:
        super().__init__()
        size = size or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        self.norm = nn.LayerNorm(size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.norm(hidden)


class BertLayer(nn.Module):
    # `relative_bias`: MPNet's layers are BERT's plus one bias table their stack shares.
    def __init__(self, config, layer_index: int, relative_bias: RelativePositionBias | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.hidden_size = hidden
        # Query, key and value in one matmul; the loader stacks their weights.
        self.qkv = packed_linear(hidden, (hidden,) * 3)
        self.attn = Attention(num_heads, hidden // num_heads, layer_index=layer_index, relative_bias=relative_bias)
        self.attn_out = Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_in = Linear(hidden, config.intermediate_size, activation=config.hidden_act)
        self.ffn_out = Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden).split(self.hidden_size, dim=-1)
        hidden = self.attn_norm(self.attn_out(self.attn(q, k, v), residual=hidden))
        return self.ffn_norm(self.ffn_out(self.ffn_in(hidden), residual=hidden))


# The MLM heads SPLADE reads (heads/splade.py): BERT's cls.predictions, RoBERTa's lm_head.
_BERT_MLM = MlmHeadNames(
    dense="cls.predictions.transform.dense",
    norm="cls.predictions.transform.LayerNorm",
    decoder="cls.predictions.decoder.weight",
    bias=("cls.predictions.bias", "cls.predictions.decoder.bias"),
    embeddings=("bert.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    activation=None,
)
_ROBERTA_MLM = MlmHeadNames(
    dense="lm_head.dense",
    norm="lm_head.layer_norm",
    decoder="lm_head.decoder.weight",
    bias=("lm_head.bias", "lm_head.decoder.bias"),
    embeddings=("roberta.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    activation="gelu",
)


class BertModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

    reads_token_types = True
    mlm_heads = {"bert": _BERT_MLM} | {model_type: _ROBERTA_MLM for model_type in ROBERTA_TYPES}

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported")
        self.config = config
        self.position_offset = config.pad_token_id + 1 if config.model_type in ROBERTA_TYPES else 0
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings - self.position_offset

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


# BertModel / *ForSequenceClassification / *ForMaskedLM names (under `bert.`, `roberta.` or `model.`), or bare.
CHECKPOINT = CheckpointNames(
    prefixes=("bert.", "roberta.", "model."),
    # Pretraining and task heads (models/heads read the ones they serve), and buffers.
    ignored=r"^(pooler\.|cls\.|lm_head\.|classifier\.|embeddings\.position_ids)",
    packed=tuple(
        (f"attention.self.{part}.", "attention.self.qkv.", index)
        for index, part in enumerate(("query", "key", "value"))
    ),
    renames=(
        (r"\.gamma$", ".weight"),
        (r"\.beta$", ".bias"),
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.qkv\.", r"layers.\1.qkv."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out."),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
    ),
)

# Classifiers read the first token through dense + tanh, then a linear layer: BERT names them
# `pooler.dense` + `classifier`, RoBERTa / XLM-R `classifier.dense` + `classifier.out_proj` (the same math).
_BERT_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    sources={
        "dense.weight": ("bert.pooler.dense.weight", "pooler.dense.weight"),
        "dense.bias": ("bert.pooler.dense.bias", "pooler.dense.bias"),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
)
ROBERTA_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    sources={
        "dense.weight": ("classifier.dense.weight",),
        "dense.bias": ("classifier.dense.bias",),
        "out.weight": ("classifier.out_proj.weight",),
        "out.bias": ("classifier.out_proj.bias",),
    },
)

FAMILY = Family(
    name="bert",
    model_types=("bert", *ROBERTA_TYPES),
    model_class=BertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={
        "BertForSequenceClassification": _BERT_CLASSIFIER,
        "RobertaForSequenceClassification": ROBERTA_CLASSIFIER,
        "XLMRobertaForSequenceClassification": ROBERTA_CLASSIFIER,
        "CamembertForSequenceClassification": ROBERTA_CLASSIFIER,
    },
    token_classifiers={
        f"{name}ForTokenClassification": TOKEN_CLASSIFIER for name in ("Bert", "Roberta", "XLMRoberta", "Camembert")
    },
    lora=True,
)

DOCS = FamilyDocs(
    examples=(
        "sentence-transformers/all-MiniLM-L6-v2",
        "BAAI/bge-base-en-v1.5",
        "intfloat/multilingual-e5-large",
        "BAAI/bge-m3",
        "cross-encoder/ms-marco-MiniLM-L-6-v2",
        "BAAI/bge-reranker-v2-m3",
        "naver/splade-cocondenser-ensembledistil",
        "colbert-ir/colbertv2.0",
    ),
    tested_by=tuple(
        f"tests/models/test_{name}.py"
        for name in (
            "encoder_parity",
            "classify_parity",
            "rerank_parity",
            "zero_shot",
            "sparse",
            "bge_m3",
            "multi_vector",
            "int8",
            "lora_parity",
            "token_classify_parity",
        )
    ),
)
