"""Heads that turn per-token hidden states into per-sequence outputs: pooling (+ Dense) for embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from embedserv.models.layers import on_padded_rows
from embedserv.models.loading.st_files import DenseSpec

_DENSE_ACTIVATIONS = {
    "Identity": nn.Identity,
    "Tanh": nn.Tanh,
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
}


@dataclass(frozen=True)
class PoolingInputs:
    """Where each sequence's pooled tokens are in the packed batch (device tensors, int64)."""

    # [num_seqs]: first token that counts (prompt tokens excluded when the model says so).
    first_index: torch.Tensor
    # [num_seqs]: last token of each sequence.
    last_index: torch.Tensor
    # [num_pooled_tokens]: rows that count, and [num_pooled_tokens]: their sequence. None when every
    # token of the batch counts (then the rows are all of them, in order).
    token_index: torch.Tensor | None
    token_seq: torch.Tensor
    # [num_seqs]: how many tokens count per sequence, as hidden's dtype would need it (float32).
    token_count: torch.Tensor


def pooled_rows(hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
    """The rows that count (all of them when pooling.token_index is None), in token_seq order."""
    return hidden if pooling.token_index is None else hidden.index_select(0, pooling.token_index)


def mean_per_sequence(rows: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
    """[num_seqs, width] float32: each sequence's mean of `rows` (pooled_rows), accumulated in float32 even
    for half-precision rows, as sentence-transformers does."""
    sums = torch.zeros(pooling.first_index.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
    return sums.index_add_(0, pooling.token_seq, rows.float()) / pooling.token_count[:, None]


@dataclass(frozen=True)
class TokenInputs:
    """Every token of the sequences that want a per-token output (sparse or multi-vector), sequence by
    sequence in batch order."""

    # [n] int64: rows of the hidden states; [n] int64: each token's sequence (0 .. num_seqs - 1); [n] int64:
    # each token's id.
    rows: torch.Tensor
    seq: torch.Tensor
    input_ids: torch.Tensor
    # Host: the sequences' request ids and token counts ([num_seqs] int64 numpy).
    request_ids: tuple[int, ...]
    lengths: object

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)


class Dense(nn.Module):
    """sentence-transformers' Dense module: Linear then an activation."""

    def __init__(self, spec: DenseSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = _DENSE_ACTIVATIONS[spec.activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(on_padded_rows(self.linear, x))


class EmbeddingPooler(nn.Module):
    """Pools [num_tokens, hidden] into [num_seqs, dim] float32, then applies the model's Dense layers."""

    def __init__(self, mode: str, dense: list[Dense]) -> None:
        super().__init__()
        if mode not in ("cls", "mean", "max", "lasttoken"):
            raise ValueError(f"pooling mode {mode!r} is not supported")
        self.mode = mode
        self.dense = nn.ModuleList(dense)

    def forward(self, hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
        pooled = self._pool(hidden, pooling)
        for layer in self.dense:
            pooled = layer(pooled.to(layer.linear.weight.dtype))
        return pooled.float()

    def _pool(self, hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
        if self.mode == "cls":
            return hidden.index_select(0, pooling.first_index)
        if self.mode == "lasttoken":
            return hidden.index_select(0, pooling.last_index)
        rows = pooled_rows(hidden, pooling)
        if self.mode == "max":
            out = rows.new_full((pooling.first_index.shape[0], rows.shape[1]), float("-inf"))
            index = pooling.token_seq[:, None].expand_as(rows)
            return out.scatter_reduce_(0, index, rows, reduce="amax")
        return mean_per_sequence(rows, pooling)
