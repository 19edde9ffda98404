"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over a flat packed batch.

The three share one architecture; they differ only in where positions start: BERT counts from 0,
RoBERTa and XLM-R from `pad_token_id + 1` (their checkpoints reserve the first rows for padding).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.models.layers import Linear

# RoBERTa-style model types, whose positions start after the padding index.
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        return self.norm(hidden)


class BertLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.hidden_size = hidden
        # Query, key and value in one matmul; the loader concatenates their weights.
        self.qkv = Linear(hidden, 3 * hidden)
        self.attn = Attention(num_heads, hidden // num_heads, layer_index=layer_index)
        self.attn_out = Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.ffn_in = Linear(hidden, config.intermediate_size, activation=config.hidden_act)
        self.ffn_out = Linear(config.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden).split(self.hidden_size, dim=-1)
        hidden = self.attn_norm(self.attn_out(self.attn(q, k, v), residual=hidden))
        return self.ffn_norm(self.ffn_out(self.ffn_in(hidden), residual=hidden))


# Hugging Face parameter names -> ours (after the model prefix is stripped); q/k/v are fused separately.
_RENAMES = [
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
]
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
_PREFIXES = ("bert.", "roberta.", "model.")
# Checkpoint entries an encoder embedder does not use (pretraining heads, buffers).
_IGNORED = re.compile(r"^(pooler\.|cls\.|lm_head\.|classifier\.|embeddings\.position_ids)")


class BertModel(nn.Module):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors in; returns the names of our parameters it filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
            if _IGNORED.match(name):
                continue
            qkv = _QKV.match(name)
            if qkv:
                layer, part, kind = qkv.groups()
                target = f"layers.{layer}.qkv.{kind}"
                index = ("query", "key", "value").index(part)
                size = self.config.hidden_size
                params[target].data[index * size : (index + 1) * size].copy_(tensor)
                loaded.add(f"{target}.{part}")
                continue
            for pattern, replacement in _RENAMES:
                name = re.sub(pattern, replacement, name)
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        for i in range(len(self.layers)):
            for kind in ("weight", "bias"):
                parts = {f"layers.{i}.qkv.{kind}.{p}" for p in ("query", "key", "value")}
                if parts <= loaded:
                    loaded -= parts
                    loaded.add(f"layers.{i}.qkv.{kind}")
        return loaded
