"""ModernBERT encoders (answerdotai's ModernBERT, gte-modernbert, modernbert-embed) over a flat packed batch.

Pre-norm blocks: LayerNorm -> attention with rotary positions -> LayerNorm -> GeGLU MLP, after a normed
token embedding (no position or token type embeddings) and before a final LayerNorm. Every
`global_attn_every_n_layers`-th layer (transformers: `layer_types`) attends over the whole sequence; the
others within a local window, with rotary tables of their own theta. Biases (attention, MLP, norms) are
config switches, all off in published models. The first layer's attention norm is an identity: the
embeddings were just normed.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear, get_activation
from embedserv.models.loading.family import CheckpointNames, Classifier, Family, FamilyDocs
from embedserv.models.rotary import RotaryEmbedding, apply_rotary


def layer_sliding_window(config, layer_index: int) -> int | None:
    """The window W of layer `layer_index` (a query at p sees the key at j only when |p - j| < W), or None.

    `local_attention` is the whole window: transformers' mask keeps |p - j| <= local_attention // 2
    (its `config.sliding_window`), so W = local_attention // 2 + 1.
    """
    if config.layer_types[layer_index] != "sliding_attention":
        return None
    return config.local_attention // 2 + 1


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        # The checkpoint keeps query, key and value as one tensor already, in that order.
        self.Wqkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            layer_index=layer_index,
            sliding_window=layer_sliding_window(config, layer_index),
        )
        self.Wo = Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention of the normed `x`, plus `residual` (fused into the output projection)."""
        qkv = self.Wqkv(x).view(-1, 3 * self.num_heads, self.head_dim)
        # Queries and keys sit side by side in the fused output: one rotation covers both.
        qk = apply_rotary(qkv[:, : 2 * self.num_heads], cos, sin)
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, 2 * self.num_heads :]
        return self.Wo(self.attn(q.flatten(1), k.flatten(1), v.flatten(1)), residual=residual)


class ModernBertMLP(nn.Module):
    """GeGLU: Wi's output halves are the input (through the activation) and its gate, in that order."""

    def __init__(self, config) -> None:
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = get_activation(config.hidden_activation)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate, residual=residual)


class ModernBertLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        norm = dict(eps=config.norm_eps, bias=config.norm_bias)
        self.attn_norm = nn.Identity() if layer_index == 0 else nn.LayerNorm(config.hidden_size, **norm)
        self.attn = ModernBertAttention(config, layer_index)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, **norm)
        self.mlp = ModernBertMLP(config)
        self.layer_type = config.layer_types[layer_index]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = self.attn(self.attn_norm(hidden), hidden, cos, sin)
        return self.mlp(self.mlp_norm(hidden), hidden)


class ModernBertModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions) -> [num_tokens, hidden]`, final norm applied."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        # Global and local layers rotate with their own theta (transformers: rope_parameters per layer type).
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = {
            kind: RotaryEmbedding(config, head_dim, self.max_positions, layer_type=kind)
            for kind in set(config.layer_types)
        }

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions) -> torch.Tensor:
        return self.run_layers(self.embeddings(input_ids), positions)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layers and the final norm over normed embeddings (ColModernVBERT's have image features in them)."""
        tables = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            hidden = layer(hidden, *tables[layer.layer_type])
        return self.final_norm(hidden)


# ModernBertModel names, bare (sentence-transformers) or under `model.` (*ForMaskedLM, the published base
# models; *ForSequenceClassification). The MLM and classifier heads are read by models/heads or not served.
CHECKPOINT = CheckpointNames(
    prefixes=("model.",),
    ignored=r"^(head\.|decoder\.|classifier\.)",
)

# ModernBertForSequenceClassification: the CLS token or the mean of every token (classifier_pooling), through
# dense (bias: classifier_bias) + classifier_activation + LayerNorm (bias: norm_bias), then `classifier`.
CLASSIFIER = Classifier(
    token=lambda config: "first" if config.classifier_pooling == "cls" else "mean",
    pooler=True,
    sources={
        "dense.weight": ("head.dense.weight",),
        "dense.bias": ("head.dense.bias",),
        "norm.weight": ("head.norm.weight",),
        "norm.bias": ("head.norm.bias",),
        "out.weight": ("classifier.weight",),
        "out.bias": ("classifier.bias",),
    },
    activation=lambda config: config.classifier_activation,
    norm=True,
    optional=("dense.bias", "norm.bias"),
)

FAMILY = Family(
    name="modernbert",
    model_types=("modernbert",),
    model_class=ModernBertModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"ModernBertForSequenceClassification": CLASSIFIER},
    # ModernBertForTokenClassification: the same prediction head and classifier on every token.
    token_classifiers={"ModernBertForTokenClassification": replace(CLASSIFIER, token="every")},
    lora=True,
)

DOCS = FamilyDocs(
    examples=(
        "answerdotai/ModernBERT-base",
        "answerdotai/ModernBERT-large",
        "Alibaba-NLP/gte-modernbert-base",
        "Alibaba-NLP/gte-reranker-modernbert-base",
        "nomic-ai/modernbert-embed-base",
    ),
    tested_by=(
        "tests/models/test_modernbert_parity.py",
        "tests/models/test_lora_parity.py",
        "tests/models/test_token_classify_parity.py",
    ),
)
