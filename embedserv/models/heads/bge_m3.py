"""bge-m3's sparse and multi-vector heads, as FlagEmbedding's BGEM3 model computes them.

bge-m3 is an XLM-R encoder with two small heads saved beside it (sparse_linear, colbert_linear: Linear
state dicts, `.pt` as FlagEmbedding saves them with torch.save, or converted to `.safetensors`):
- lexical weights: per token relu(sparse_linear(hidden)); per (sequence, token id) the largest weight of
  that id's tokens, special tokens (cls, eos/sep, pad, unk) left out, only weights above 0;
- colbert vectors: normalize(colbert_linear(hidden)) for every token but the first (the engine drops the
  first, as bge-m3's entry in models/registry.HEAD_KINDS says).
The dense output is the ordinary pooler (CLS, Normalize) of the sentence-transformers files.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from embedserv.errors import ConfigError
from embedserv.models.heads.pooling import TokenInputs
from embedserv.models.layers import on_padded_rows
from embedserv.models.loading.checkpoint import read_head_file
from embedserv.models.loading.model_spec import ModelSpec

# The tokenizer's special tokens FlagEmbedding leaves out of the lexical weights (sep: eos for BERT-style
# tokenizers; bge-m3's XLM-R tokenizer has the same </s> for both).
_SPECIAL_TOKENS = ("cls_token_id", "eos_token_id", "sep_token_id", "pad_token_id", "unk_token_id")


def _read_linear(spec: ModelSpec, path: Path, allow_pickle: bool) -> nn.Linear:
    """An nn.Linear from a head file ({weight [out, hidden], bias [out]}) on spec.device in spec.dtype."""
    state = read_head_file(path, allow_pickle)
    weight, bias = state.get("weight"), state.get("bias")
    hidden = spec.hf_config.hidden_size
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden or set(state) - {"weight", "bias"}:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in state.items()) or "nothing"
        raise ConfigError(
            f"{path}: expected a Linear's state dict (weight [out, {hidden}], bias [out]); it holds {shapes}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ConfigError(f"{path}: bias has shape {tuple(bias.shape)}, the weight {tuple(weight.shape)}")
    linear = nn.Linear(hidden, weight.shape[0], bias=bias is not None)
    linear.load_state_dict(state)
    return linear.to(device=spec.device, dtype=spec.dtype).eval().requires_grad_(False)


def _head_path(spec: ModelSpec, index: int) -> Path:
    # OutputSpec.head_files: sparse_linear, then colbert_linear.
    return spec.outputs.head_files[index]


def special_token_ids(model_dir: Path) -> list[int]:
    """The ids FlagEmbedding drops from the lexical weights, read off the model's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    ids = {getattr(tokenizer, name, None) for name in _SPECIAL_TOKENS}
    return sorted(i for i in ids if isinstance(i, int))


class LexicalWeightsHead(nn.Module):
    """forward(hidden [num_tokens, hidden], tokens) -> (seq, index, value) [nnz] sorted by (sequence, token
    id): each sequence's largest relu(sparse_linear(hidden)) per token id, special ids left out, above 0."""

    def __init__(self, linear: nn.Linear, special_ids: list[int], vocab_size: int) -> None:
        super().__init__()
        if linear.out_features != 1:
            raise ValueError(f"sparse_linear has {linear.out_features} outputs, not 1")
        self.linear = linear
        self.register_buffer("special_ids", torch.tensor(special_ids, dtype=torch.int64), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, tokens: TokenInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = torch.relu(on_padded_rows(self.linear, hidden.index_select(0, tokens.rows))).squeeze(-1).float()
        keep = (weights > 0) & ~torch.isin(tokens.input_ids, self.special_ids)
        # One key per (sequence, id): unique sorts them, so the entries come out sorted, and the max per key
        # needs no [num_seqs, vocab] tensor (bge-m3's vocabulary has 250k ids).
        keys = (tokens.seq * self.vocab_size + tokens.input_ids)[keep]
        unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        values = weights.new_zeros(unique.shape[0])
        values.scatter_reduce_(0, inverse, weights[keep], "amax", include_self=False)
        return unique // self.vocab_size, unique % self.vocab_size, values


class ColbertHead(nn.Module):
    """rows [n, hidden] -> [n, dim] float32: colbert_linear, then L2-normalized."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.normalize(on_padded_rows(self.linear, rows).float(), dim=-1)


def build_sparse_head(spec: ModelSpec, allow_pickle: bool) -> LexicalWeightsHead:
    path = _head_path(spec, 0)
    linear = _read_linear(spec, path, allow_pickle)
    if linear.out_features != 1:
        raise ConfigError(f"{path}: sparse_linear must have one output, it has {linear.out_features}")
    special = special_token_ids(spec.model_dir)
    # Keys are seq * stride + id: the stride must pass every id the tokenizer can give.
    stride = max(int(spec.hf_config.vocab_size), max(special, default=0) + 1)
    return LexicalWeightsHead(linear, special, stride).to(spec.device).eval()


def build_colbert_head(spec: ModelSpec, allow_pickle: bool) -> ColbertHead:
    return ColbertHead(_read_linear(spec, _head_path(spec, 1), allow_pickle)).eval()
