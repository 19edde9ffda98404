"""Low-rank (LoRA) updates over a flat packed batch whose rows may each run a different adapter.

A row of adapter a computes `W x + scaling * B_a (A_a x)`; rows without an adapter, `W x`. Never a step per
adapter; two ways to route rows, both with the adapters' A [adapters, rank, in] and B [adapters, out, rank]:

- masked (`Routes`, `LowRank.add_to`): the present adapters stack into one [k * rank, in] and one
  [out, k * rank] matmul over every row, a mask keeping each row's own columns. Rows stay where they are,
  which jina-embeddings-v3's task adapters need (families/jina_v3.py passes the routes down its layers);
  the cost grows with k * rank.
- by rows (`AdapterRows`, `LowRank.add_by_rows`): the input builder packs each adapter's sequences side by
  side, so an adapter's rows are one slice and each row pays for its own adapter's rank only. PEFT adapters
  served with --lora take this way: LoraLinear wraps a model's Linear and finds the step's AdapterRows in
  the forward context the runner sets, so no family's code changes (loading/lora_files.py attaches them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from embedserv.forward_context import get_forward_context
from embedserv.models.layers import Linear, get_activation


@dataclass(frozen=True)
class Routes:
    """The adapters present in a step, and which rows each applies to."""

    # [k] int64: the adapters present, ascending.
    adapters: torch.Tensor
    # [num_tokens, k, 1]: 1 where the row's adapter is that one, else 0 (rows without an adapter: all 0);
    # None when one adapter covers every row.
    mask: torch.Tensor | None


def routes_of(adapter_ids: torch.Tensor | None, dtype: torch.dtype) -> Routes | None:
    """The step's routes, or None when no token has an adapter; one host sync per step, not per layer."""
    if adapter_ids is None:
        return None
    present = torch.unique(adapter_ids)
    adapters = present[present >= 0]
    if len(adapters) == 0:
        return None
    if len(adapters) == len(present) == 1:
        return Routes(adapters, None)
    return Routes(adapters, (adapter_ids[:, None] == adapters[None, :]).to(dtype).unsqueeze(-1))


def masked(xa: torch.Tensor, routes: Routes) -> torch.Tensor:
    """[num_tokens, k * rank] low-rank activations, each row's kept only for its own adapter."""
    if routes.mask is None:
        return xa
    return (xa.view(xa.shape[0], routes.mask.shape[1], -1) * routes.mask).flatten(1)


class LowRank(nn.Module):
    """The low-rank updates of one linear, one per adapter: `lora_A` [adapters, rank, in], `lora_B`
    [adapters, out, rank] (jina-embeddings-v3's checkpoint layout; PEFT's per adapter, stacked)."""

    def __init__(self, in_features: int, out_features: int, num_adapters: int, rank: int, scaling: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(num_adapters, rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(num_adapters, out_features, rank))
        self.scaling = scaling
        # A packed linear's (q/k/v in one qkv) B is block-diagonal: (output start, end, rank start, end) per
        # shard, so add_by_rows multiplies the blocks alone. Empty: B is dense.
        self.blocks: tuple[tuple[int, int, int, int], ...] = ()

    def add_to(self, out: torch.Tensor, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        """`out` (the base linear's output for `x`) plus each row's update, in place."""
        a = self.lora_A[routes.adapters].flatten(0, 1)
        b = self.lora_B[routes.adapters].permute(1, 0, 2).flatten(1)
        return out.addmm_(masked(x @ a.T, routes), b.T, alpha=self.scaling)

    def add_by_rows(self, out: torch.Tensor, x: torch.Tensor, routes: AdapterRows) -> torch.Tensor:
        """The same, one run of rows per adapter: each row pays for its own adapter's rank only, where the mask
        pays for every present adapter's (4 mixed adapters of rank 16 on every linear of MiniLM: 0.55x the
        base's throughput masked; benchmarks/lora.py measures this path)."""
        for adapter, rows in zip(routes.adapters, routes.rows, strict=True):
            xa, b = x[rows] @ self.lora_A[adapter].T, self.lora_B[adapter]
            if not self.blocks:
                out[rows].addmm_(xa, b.T, alpha=self.scaling)
            # Column slices of out and b: strided views the matmul writes and reads in place.
            for start, end, first, last in self.blocks:
                out[rows, start:end].addmm_(xa[:, first:last], b[start:end, first:last].T, alpha=self.scaling)
        return out


class LowRankEmbedding(nn.Module):
    """An embedding table's low-rank updates: row i of adapter t gains `scaling * lora_A[t, i] @ lora_B[t]`
    (`lora_A` [adapters, rows, rank], `lora_B` [adapters, rank, dim]: jina-embeddings-v3's layout)."""

    def __init__(self, num_rows: int, dim: int, num_adapters: int, rank: int, scaling: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(num_adapters, num_rows, rank))
        self.lora_B = nn.Parameter(torch.empty(num_adapters, rank, dim))
        self.scaling = scaling

    def add_to(self, out: torch.Tensor, ids: torch.Tensor, routes: Routes) -> torch.Tensor:
        a = self.lora_A[routes.adapters][:, ids].permute(1, 0, 2).flatten(1)
        b = self.lora_B[routes.adapters].flatten(0, 1)
        return out.addmm_(masked(a, routes), b, alpha=self.scaling)


@dataclass(frozen=True)
class AdapterRows:
    """A --lora step's rows per adapter: the input builder packs each adapter's sequences side by side, so
    each adapter present (ascending) has one contiguous run of rows: a view, no gather or scatter."""

    adapters: tuple[int, ...]
    # Row slices, one per adapter; slice(None) when one adapter has every row (the padding rows after them then
    # get an update nobody reads).
    rows: tuple[slice, ...]


def adapter_rows(adapters: np.ndarray, packed_lens: np.ndarray) -> AdapterRows | None:
    """`adapters`: each sequence's adapter (-1: the base) in packed order, which groups equal adapters;
    `packed_lens`: their tokens. None when no sequence has an adapter. Host ints only: no device sync."""
    present = [int(a) for a in np.unique(adapters) if a >= 0]
    if not present:
        return None
    if len(present) == 1 and bool((adapters == present[0]).all()):
        return AdapterRows(tuple(present), (slice(None),))
    ends = np.cumsum(packed_lens)
    rows = []
    for adapter in present:
        (members,) = np.nonzero(adapters == adapter)
        first, last = int(members[0]), int(members[-1])
        if last - first + 1 != len(members):
            raise ValueError("adapter_rows needs each adapter's sequences side by side")
        rows.append(slice(int(ends[first] - packed_lens[first]), int(ends[last])))
    return AdapterRows(tuple(present), tuple(rows))


class LoraLinear(nn.Module):
    """A model's Linear plus served adapters' updates (--lora): `base(x)` on steps without adapter rows, else
    `activation(W x + b + B_a A_a x) (+ residual)` per row. The activation a Linear may fuse comes after the
    update, so rows with adapters run the linear without it and apply it here."""

    def __init__(self, base: Linear, low_rank: LowRank) -> None:
        super().__init__()
        self.base = base
        self.low_rank = low_rank
        self.activation = get_activation(base.activation) if base.activation else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        routes = get_forward_context().lora
        if routes is None:
            return self.base(x, residual)
        if self.activation is None:
            return self.low_rank.add_by_rows(self.base(x, residual), x, routes)
        return self.activation(self.low_rank.add_by_rows(self.base.without_activation(x), x, routes))


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLinear) for module in model.modules())
