"""torch's scaled_dot_product_attention over a packed batch, without padding.

SDPA wants [batch, heads, length, head_size]. Sequences of equal length that sit side by side in the
packed batch already are that shape as a view, so this backend makes one SDPA call per run of equal
lengths: no padding, no masks, no scatter. The input builder packs longest first, so a batch has at
most as many runs as distinct lengths, and the long truncated inputs that dominate the cost share one.
On CPU in bfloat16, long runs use two batched matmuls instead of the flash kernel (faster there).

With a KV cache (generation), decoding sequences (one query each) go in one padded call, keys read
straight from the cache and a mask hiding the padding; prompt chunks run one call each on their keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from embedserv.attention.backends.base import gather_kv, write_kv
from embedserv.attention.backends.naive import future_mask
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


# On CPU in bfloat16 two batched matmuls beat the flash kernel from this length on, as long as the
# materialized scores stay in cache: runs are cut into chunks of at most _SCORES_BYTES of scores.
# Measured with benchmarks/attention_kernels.py.
_CPU_BF16_MATMUL_MIN_LENGTH = 64
_SCORES_BYTES = 2_500_000


@dataclass(frozen=True)
class _Run:
    """Consecutive sequences of one length: rows [token_start, token_start + num_seqs * length)."""

    token_start: int
    num_seqs: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.token_start, self.token_start + self.num_seqs * self.length)


@dataclass(frozen=True)
class _PagedPlan:
    """How a generation step splits into SDPA calls."""

    # [num_decodes] int64: the query row of each one-token sequence; None when there is none.
    decode_rows: torch.Tensor | None
    # [num_decodes, longest decode context] int64 cache slots (padding points at slot 0, masked out).
    decode_slots: torch.Tensor | None
    # [num_decodes, 1, 1, longest decode context] bool: True for real keys (padding is masked out).
    decode_mask: torch.Tensor | None
    # (query rows, packed key rows, query length, key length) of every longer chunk.
    chunks: tuple[tuple[slice, slice, int, int], ...]


@dataclass(frozen=True)
class SdpaMetadata(AttentionMetadata):
    runs: tuple[_Run, ...]
    paged: _PagedPlan | None = None


def plan_runs(seq_lens: np.ndarray) -> tuple[_Run, ...]:
    """Splits the packed batch where the sequence length changes."""
    if len(seq_lens) == 0:
        return ()
    breaks = np.flatnonzero(np.diff(seq_lens)) + 1
    firsts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((firsts, [len(seq_lens)])))
    token_starts = np.concatenate(([0], np.cumsum(seq_lens)))[firsts]
    return tuple(
        _Run(int(start), int(count), int(seq_lens[first]))
        for start, count, first in zip(token_starts, counts, firsts)
    )


class SdpaBackend:
    name = "sdpa"

    def build_metadata(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        if common.reads_kv_cache:
            return SdpaMetadata(common=common, runs=(), paged=plan_paged(common))
        return SdpaMetadata(common=common, runs=plan_runs(common.seq_lens_q_cpu))

    def forward(self, layer, q, k, v, kv_cache, meta: SdpaMetadata) -> torch.Tensor:
        if kv_cache is not None:
            return _forward_paged(layer, q, k, v, kv_cache, meta)
        gqa = q.shape[1] != k.shape[1]
        runs = meta.runs
        return _concat([self._attend(layer, q[r.rows], k[r.rows], v[r.rows], r, meta.is_causal, gqa) for r in runs])

    @staticmethod
    def _attend(layer, q, k, v, run: _Run, is_causal: bool, gqa: bool) -> torch.Tensor:
        """Rows of one run -> [rows, heads, head_size]."""
        shape = (run.num_seqs, run.length)
        qb = q.view(*shape, *q.shape[1:]).transpose(1, 2)
        kb = k.view(*shape, *k.shape[1:]).transpose(1, 2)
        vb = v.view(*shape, *v.shape[1:]).transpose(1, 2)
        if q.device.type == "cpu" and q.dtype == torch.bfloat16 and run.length >= _CPU_BF16_MATMUL_MIN_LENGTH:
            per_chunk = max(1, _SCORES_BYTES // (q.shape[1] * run.length**2 * q.element_size()))
            out = _concat([
                _attend_with_matmuls(qb[i : i + per_chunk], kb[i : i + per_chunk], vb[i : i + per_chunk],
                                     layer.scale, is_causal)
                for i in range(0, run.num_seqs, per_chunk)
            ])
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=is_causal, scale=layer.scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(-1, *q.shape[1:])


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy when there is one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_with_matmuls(q, k, v, scale: float, is_causal: bool) -> torch.Tensor:
    """[n, heads, L, d] attention as two batched matmuls: the same function, materialized scores."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if is_causal:
        length = q.shape[2]
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(future, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def plan_paged(common: CommonAttentionMetadata) -> _PagedPlan:
    lens_q, lens_k = common.seq_lens_q_cpu, common.seq_lens_k_cpu
    starts_q = np.concatenate(([0], np.cumsum(lens_q)[:-1]))
    starts_k = np.concatenate(([0], np.cumsum(lens_k)[:-1]))
    device = common.key_slots.device
    decodes = np.flatnonzero(lens_q == 1)
    rows = slots = mask = None
    if len(decodes):
        longest = int(lens_k[decodes].max())
        offsets = np.arange(longest)
        real = offsets[None, :] < lens_k[decodes, None]
        index = np.where(real, starts_k[decodes, None] + offsets[None, :], 0)
        rows = torch.from_numpy(starts_q[decodes]).to(device)
        slots = common.key_slots[torch.from_numpy(index).to(device)].masked_fill_(
            ~torch.from_numpy(real).to(device), 0
        )
        mask = torch.from_numpy(real).to(device)[:, None, None, :]
    chunks = tuple(
        (slice(int(starts_q[i]), int(starts_q[i] + lens_q[i])), slice(int(starts_k[i]), int(starts_k[i] + lens_k[i])),
         int(lens_q[i]), int(lens_k[i]))
        for i in np.flatnonzero(lens_q != 1)
    )
    return _PagedPlan(decode_rows=rows, decode_slots=slots, decode_mask=mask, chunks=chunks)


def _forward_paged(layer, q, k, v, kv_cache, meta: SdpaMetadata) -> torch.Tensor:
    write_kv(k, v, kv_cache, meta.common)
    plan = meta.paged
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        keys, values = gather_kv(kv_cache, plan.decode_slots)  # [n, longest, kv_heads, d]
        queries = q[plan.decode_rows]
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            out[plan.decode_rows] = _decode_with_matmuls(queries, keys, values, plan.decode_mask, layer.scale)
        else:
            attended = F.scaled_dot_product_attention(
                queries.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=plan.decode_mask, scale=layer.scale, enable_gqa=gqa,
            )
            out[plan.decode_rows] = attended.squeeze(2)
    for rows, key_rows, len_q, len_k in plan.chunks:
        keys, values = gather_kv(kv_cache, meta.common.key_slots[key_rows])
        # A whole prompt (as many queries as keys) is plain causal; a later chunk sees all earlier keys.
        mask = None if len_q == len_k else ~future_mask(len_q, len_k, q.device)
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=gqa,
        )
        out[rows] = attended[0].transpose(0, 1)
    return out


def _decode_with_matmuls(q, keys, values, mask, scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls in float32: q [n, H, d], keys/values [n, L, kv_heads, d]
    -> [n, H, d]. On CPU in bfloat16, SDPA's flash kernel spent half of a decode step on these one-row
    queries, about 4x this (32 streams of a 30-layer model: 115 -> 55 ms a step); in float32 SDPA is the
    faster. Query heads are grouped by the KV head they share, so grouped-query attention repeats nothing."""
    n, heads, size = q.shape
    kv_heads = keys.shape[2]
    grouped = q.float().view(n, kv_heads, heads // kv_heads, size)
    scores = torch.matmul(grouped, keys.float().permute(0, 2, 3, 1)).mul_(scale)  # [n, kv_heads, group, L]
    scores.masked_fill_(~mask.view(n, 1, 1, -1), float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), values.float().transpose(1, 2))  # [n, kv_heads, group, d]
    return out.view(n, heads, size).to(q.dtype)
