"""torch's scaled_dot_product_attention over a packed batch, without padding.

SDPA wants [batch, heads, length, head_size]. Sequences of equal length that sit side by side in the
packed batch already are that shape as a view, so this backend makes one SDPA call per run of equal
lengths: no padding, no masks, no scatter. The input builder packs longest first, so a batch has at
most as many runs as distinct lengths, and the long truncated inputs that dominate the cost share one.
On CPU in bfloat16, long runs use two batched matmuls instead of the flash kernel (faster there).

With a paged KV cache, decoding sequences (one query each) go in one padded call over whole blocks read
through their block tables (one index per block, not per token) and a mask hiding what lies past each
sequence's length. Prompt chunks run one call each: a whole prompt attends over its own new keys and
never reads the cache; a chunk with context reads its blocks. All of it is planned once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from embedserv.attention.backends.base import PagedBackendBase, gather_blocks, write_kv
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
class _Chunk:
    """A sequence with more than one query (a prompt or a prompt chunk): one SDPA call of its own."""

    rows: slice
    len_q: int
    len_k: int
    # [ceil(len_k / block_size)] int32: its blocks, for reading its keys from the cache.
    table: torch.Tensor
    # [len_q, len_k] bool, True where a query sees a key; None when it has no context (plain causal).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _PagedPlan:
    """How a step over the paged cache splits into SDPA calls; built once per step, used by every layer."""

    # [num_decodes] int64: the query row of each one-token sequence; None when there is none.
    decode_rows: torch.Tensor | None
    # [num_decodes, blocks of the longest decode] int32: their block tables (padding entries are masked).
    decode_tables: torch.Tensor | None
    # [num_decodes, 1, 1, blocks * block_size] bool: True for each decode's real keys.
    decode_mask: torch.Tensor | None
    chunks: tuple[_Chunk, ...]


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


class SdpaBackend(PagedBackendBase):
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
    """Host-side planning from the host lengths; device tensors are sliced or copied here, once per step."""
    lens_q, lens_k, size = common.seq_lens_q_cpu, common.seq_lens_k_cpu, common.block_size
    starts_q = np.concatenate(([0], np.cumsum(lens_q)[:-1]))
    device = common.block_tables.device
    decodes = np.flatnonzero(lens_q == 1)
    rows = tables = mask = None
    if len(decodes):
        num_blocks = -(-int(lens_k[decodes].max()) // size)
        rows = torch.from_numpy(starts_q[decodes]).to(device)
        tables = common.block_tables[rows.new_tensor(decodes), :num_blocks]
        real = np.arange(num_blocks * size)[None, :] < lens_k[decodes, None]
        mask = torch.from_numpy(real).to(device)[:, None, None, :]
    chunks = []
    for i in np.flatnonzero(lens_q != 1):
        len_q, len_k = int(lens_q[i]), int(lens_k[i])
        chunks.append(_Chunk(
            rows=slice(int(starts_q[i]), int(starts_q[i]) + len_q), len_q=len_q, len_k=len_k,
            table=common.block_tables[int(i), : -(-len_k // size)],
            mask=None if len_q == len_k else ~future_mask(len_q, len_k, device),
        ))
    return _PagedPlan(decode_rows=rows, decode_tables=tables, decode_mask=mask, chunks=tuple(chunks))


def _forward_paged(layer, q, k, v, kv_cache, meta: SdpaMetadata) -> torch.Tensor:
    write_kv(k, v, kv_cache, meta.common)
    plan = meta.paged
    gqa = q.shape[1] != kv_cache.shape[-2]
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        # One coarse gather of whole blocks for every decode: [n, blocks * block_size, kv_heads, d].
        keys, values = gather_blocks(kv_cache, plan.decode_tables)
        queries = q[plan.decode_rows]
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            out[plan.decode_rows] = _decode_with_matmuls(queries, keys, values, plan.decode_mask, layer.scale)
        else:
            attended = F.scaled_dot_product_attention(
                queries.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=plan.decode_mask, scale=layer.scale, enable_gqa=gqa,
            )
            out[plan.decode_rows] = attended.squeeze(2)
    for chunk in plan.chunks:
        out[chunk.rows] = _attend_chunk(layer, q[chunk.rows], k, v, kv_cache, chunk, gqa)
    return out


def _attend_chunk(layer, q, k, v, kv_cache, chunk: _Chunk, gqa: bool) -> torch.Tensor:
    """One prompt chunk: [len_q, heads, d]. A whole prompt with its own keys never touches the cache."""
    if chunk.mask is None and k is not None:
        run = _Run(token_start=0, num_seqs=1, length=chunk.len_q)
        return SdpaBackend._attend(layer, q, k[chunk.rows], v[chunk.rows], run, True, gqa)
    keys, values = gather_blocks(kv_cache, chunk.table)
    keys, values = keys[: chunk.len_k], values[: chunk.len_k]
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=layer.scale, enable_gqa=gqa,
    )
    return attended[0].transpose(0, 1)


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
