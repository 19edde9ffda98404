"""How the sdpa backend splits a step into calls of one shape each, planned on the host once per step: on
KV-free steps runs of sequences of one length (self-attention), or of one query length (cross-attention
and suffix queries, whose keys are packed apart); over the paged cache, one padded call for the decodes
and one per prompt chunk. SdpaMetadata carries the plan to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from embedserv.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class Run:
    """Consecutive sequences of one length: rows [token_start, token_start + num_seqs * length)."""

    token_start: int
    num_seqs: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.token_start, self.token_start + self.num_seqs * self.length)


@dataclass(frozen=True)
class CrossRun:
    """KV-free cross-attention (or suffix queries): consecutive sequences of one query length, query rows
    [q_start, q_start + num_seqs * len_q). Their keys are the view [k_start, k_start + num_seqs * len_k)
    when they share one key length, else gathered by `key_rows` and padded to the longest (len_k)."""

    q_start: int
    num_seqs: int
    len_q: int
    k_start: int
    len_k: int
    # [num_seqs, len_k] int64: each padded key's row in k (padding repeats a real row); None for a view.
    key_rows: torch.Tensor | None = None
    # [num_seqs, 1, 1, len_k] bool: True for each sequence's real keys; None for a view.
    key_mask: torch.Tensor | None = None

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_start + self.num_seqs * self.len_q)

    @property
    def k_rows(self) -> slice:
        return slice(self.k_start, self.k_start + self.num_seqs * self.len_k)


def plan_runs(seq_lens: np.ndarray) -> tuple[Run, ...]:
    """Splits the packed batch where the sequence length changes."""
    if len(seq_lens) == 0:
        return ()
    breaks = np.flatnonzero(np.diff(seq_lens)) + 1
    firsts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((firsts, [len(seq_lens)])))
    token_starts = np.concatenate(([0], np.cumsum(seq_lens)))[firsts]
    return tuple(
        Run(int(start), int(count), int(seq_lens[first]))
        for start, count, first in zip(token_starts, counts, firsts, strict=True)
    )


def plan_cross_runs(lens_q: np.ndarray, lens_k: np.ndarray, device: torch.device) -> tuple[CrossRun, ...]:
    """Splits a KV-free cross (or suffix-query) batch where the query length changes, and where the key length changes
    between sequences of more than one query (padding their keys would cost len_q rows of scores per
    key; a single query's padding costs one)."""
    n = len(lens_q)
    if n == 0:
        return ()
    lens_q, lens_k = np.asarray(lens_q, dtype=np.int64), np.asarray(lens_k, dtype=np.int64)
    change = (np.diff(lens_q) != 0) | ((np.diff(lens_k) != 0) & (lens_q[1:] > 1))
    firsts = np.concatenate(([0], np.flatnonzero(change) + 1))
    lasts = np.concatenate((firsts[1:], [n]))
    starts_q = np.concatenate(([0], np.cumsum(lens_q)))
    starts_k = np.concatenate(([0], np.cumsum(lens_k)))
    runs = []
    for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
        run_k = lens_k[first:last]
        longest = int(run_k.max())
        rows = mask = None
        if (run_k != longest).any():
            offsets = np.arange(longest)[None, :]
            real = offsets < run_k[:, None]
            rows_np = starts_k[first:last, None] + np.minimum(offsets, np.maximum(run_k[:, None] - 1, 0))
            rows = torch.from_numpy(rows_np).to(device)
            mask = torch.from_numpy(real).to(device)[:, None, None, :]
        runs.append(
            CrossRun(
                q_start=int(starts_q[first]),
                num_seqs=last - first,
                len_q=int(lens_q[first]),
                k_start=int(starts_k[first]),
                len_k=longest,
                key_rows=rows,
                key_mask=mask,
            )
        )
    return tuple(runs)


@dataclass(frozen=True)
class Chunk:
    """A sequence with more than one query (a prompt or a prompt chunk): one SDPA call of its own."""

    rows: slice
    len_q: int
    len_k: int
    # [ceil(len_k / block_size)] int32: its blocks, for reading its keys from the cache.
    table: torch.Tensor
    # [len_q, len_k] bool, True where a query sees a key; None when it sees every key up to its own
    # position with no context (plain causal), or every key (cross).
    mask: torch.Tensor | None
    causal: bool = True
    # A whole prompt of self-attention: its keys are this step's rows of k (when given), the cache
    # need not be read.
    own_keys: bool = False


@dataclass(frozen=True)
class PagedPlan:
    """How a step over the paged cache splits into SDPA calls; built once per step, used by every layer."""

    # [num_decodes] int64: the query row of each one-token sequence; None when there is none.
    decode_rows: torch.Tensor | None
    # [num_decodes, blocks of the longest decode] int32: their block tables (padding entries are masked).
    decode_tables: torch.Tensor | None
    # [num_decodes, 1, 1, blocks * block_size] bool: True for each decode's real keys.
    decode_mask: torch.Tensor | None
    chunks: tuple[Chunk, ...]
    # [num_decodes] int64: each decode's query position (its key count - 1), for the relative bias.
    decode_positions: torch.Tensor | None = None


@dataclass(frozen=True)
class SdpaMetadata(AttentionMetadata):
    runs: tuple[Run, ...] | tuple[CrossRun, ...]
    paged: PagedPlan | None = None
    # KV-free suffix queries (the prefill skip): `runs` are CrossRuns over self-attention keys.
    suffix: bool = False
    # What a step's layers share and only the first that needs it makes (bias and window masks):
    # base.step_memo.
    memo: dict = field(default_factory=dict, compare=False, repr=False)
