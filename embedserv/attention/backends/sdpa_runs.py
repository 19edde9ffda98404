"""How the sdpa backend splits a KV-free packed batch into calls of one shape each, planned on the host
once per step: runs of sequences of one length (self-attention), or of one query length (cross-attention
and suffix queries, whose keys are packed apart)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
        for start, count, first in zip(token_starts, counts, firsts)
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
    for first, last in zip(firsts.tolist(), lasts.tolist()):
        run_k = lens_k[first:last]
        longest = int(run_k.max())
        rows = mask = None
        if (run_k != longest).any():
            offsets = np.arange(longest)[None, :]
            real = offsets < run_k[:, None]
            rows_np = starts_k[first:last, None] + np.minimum(offsets, np.maximum(run_k[:, None] - 1, 0))
            rows = torch.from_numpy(rows_np).to(device)
            mask = torch.from_numpy(real).to(device)[:, None, None, :]
        runs.append(CrossRun(
            q_start=int(starts_q[first]), num_seqs=last - first, len_q=int(lens_q[first]),
            k_start=int(starts_k[first]), len_k=longest, key_rows=rows, key_mask=mask,
        ))
    return tuple(runs)
