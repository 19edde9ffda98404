"""DistilBERT encoders (msmarco-distilbert-*, distiluse-base-multilingual-cased, ...) over a flat packed batch.

DistilBERT is BERT with half the layers and no token types: word + position embeddings (positions from 0)
and BERT's post-norm layer, under other config names (dim, n_heads, hidden_dim, activation) and with
every LayerNorm's epsilon fixed at 1e-12. So the layer is bert.py's, built from a view of the config under
BERT's names.

`sinusoidal_pos_embds` is served: it only decides how transformers initializes the position table, which
the checkpoint stores like a learned one and which both transformers and we read from it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from embedserv.models.families.bert import BertLayer
from embedserv.models.interface import EncoderModel
from embedserv.models.loading.family import TOKEN_CLASSIFIER, CheckpointNames, Classifier, Family, FamilyDocs

# transformers hard-codes it for every DistilBERT LayerNorm.
_LAYER_NORM_EPS = 1e-12


def _bert_names(config) -> SimpleNamespace:
    """The config fields BertLayer reads, under BERT's names."""
    return SimpleNamespace(
        hidden_size=config.dim,
        num_attention_heads=config.n_heads,
        intermediate_size=config.hidden_dim,
        hidden_act=config.activation,
        layer_norm_eps=_LAYER_NORM_EPS,
    )


class DistilBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        self.norm = nn.LayerNorm(config.dim, eps=_LAYER_NORM_EPS)

    def forward(self, input_ids, positions) -> torch.Tensor:
        return self.norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class DistilBertModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions) -> [num_tokens, dim]`: DistilBERT has no token types."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = DistilBertEmbeddings(config)
        names = _bert_names(config)
        self.layers = nn.ModuleList(BertLayer(names, i) for i in range(config.n_layers))

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


# DistilBertModel / DistilBertFor* names (under `distilbert.`), or bare (sentence-transformers).
CHECKPOINT = CheckpointNames(
    prefixes=("distilbert.",),
    # The MLM and task heads (models/heads read the ones they serve), and a buffer.
    ignored=r"^(vocab_transform\.|vocab_layer_norm\.|vocab_projector\.|pre_classifier\.|classifier\.|qa_outputs\."
    r"|embeddings\.position_ids)",
    packed=tuple((f"attention.{part}_lin.", "attention.qkv.", index) for index, part in enumerate("qkv")),
    renames=(
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^transformer\.layer\.(\d+)\.attention\.qkv\.", r"layers.\1.qkv."),
        (r"^transformer\.layer\.(\d+)\.attention\.out_lin\.", r"layers.\1.attn_out."),
        (r"^transformer\.layer\.(\d+)\.sa_layer_norm\.", r"layers.\1.attn_norm."),
        (r"^transformer\.layer\.(\d+)\.ffn\.lin1\.", r"layers.\1.ffn_in."),
        (r"^transformer\.layer\.(\d+)\.ffn\.lin2\.", r"layers.\1.ffn_out."),
        (r"^transformer\.layer\.(\d+)\.output_layer_norm\.", r"layers.\1.ffn_norm."),
    ),
)

# DistilBertForSequenceClassification: the first token through pre_classifier + ReLU, then classifier.
_CLASSIFIER = Classifier(
    token="first",
    pooler=True,
    activation="relu",
    sources={
        "dense.weight": ("pre_classifier.weight",),
        "dense.bias": ("pre_classifier.bias",),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
)

FAMILY = Family(
    name="distilbert",
    model_types=("distilbert",),
    model_class=DistilBertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"DistilBertForSequenceClassification": _CLASSIFIER},
    token_classifiers={"DistilBertForTokenClassification": TOKEN_CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=(
        "sentence-transformers/msmarco-distilbert-base-v4",
        "sentence-transformers/distiluse-base-multilingual-cased-v2",
        "sentence-transformers/multi-qa-distilbert-cos-v1",
        "distilbert/distilbert-base-uncased-finetuned-sst-2-english",
    ),
    tested_by=("tests/models/test_distilbert_parity.py", "tests/models/test_token_classify_parity.py"),
)
