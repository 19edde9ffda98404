"""The oracle: one sequence at a time, explicit softmax in float32. Slow, obviously right.

With a paged KV cache each sequence reads all of its keys (context and this step's, just written) out of the cache
through its own row of the block tables, so the oracle checks the block tables too. Cross attention (decoder queries
over encoder keys) is the same loop without the causal mask; T5's relative position bias is added to each sequence's
scores by distance, and a sliding window hides the keys too far from a query. DeBERTa's disentangled bias is
computed here straight from its definition, gathering each pair's position projections (memory Lq * Lk * heads *
head_size; the other backends gather scores). Queries are the last len_q of their sequence's len_k positions on
every path: KV-free with len_q == len_k, KV-free suffix queries (the prefill skip) and paged steps alike.
"""

from __future__ import annotations

import math

import torch

from embedserv.attention.backends.base import AttentionLayer, PagedBackendBase, write_kv
from embedserv.attention.backends.windows import visible_keys
from embedserv.attention.disentangled import PositionProjections, refuse_disentangled
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata


class NaiveBackend(PagedBackendBase):
    name = "naive"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(common=common)

    def forward(
        self,
        layer: AttentionLayer,
        q,
        k,
        v,
        kv_cache,
        meta: AttentionMetadata,
        positions: PositionProjections | None = None,
    ) -> torch.Tensor:
        common = meta.common
        if kv_cache is not None or common.cross or meta.is_causal:
            refuse_disentangled(layer, self.name, "paged, cross or causal attention")
        if kv_cache is not None:
            write_kv(k, v, kv_cache, common)
        scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        kv_heads = kv_cache.shape[-2] if kv_cache is not None else k.shape[1]
        bias = getattr(layer, "relative_bias", None)
        table = bias.distance_table() if bias is not None else None
        disentangled = getattr(layer, "disentangled", None)
        rows_table = disentangled.index_table(q.device) if disentangled is not None else None
        group = q.shape[1] // kv_heads
        out = torch.empty_like(q)
        q_start = k_start = 0
        lengths = zip(common.seq_lens_q_cpu.tolist(), common.seq_lens_k_cpu.tolist(), strict=True)
        for seq, (len_q, len_k) in enumerate(lengths):
            rows = slice(q_start, q_start + len_q)
            if kv_cache is None:
                keys, values = k[k_start : k_start + len_k], v[k_start : k_start + len_k]
            else:
                keys, values = read_sequence(kv_cache, common, seq, len_k)
            qs = q[rows].float().transpose(0, 1)  # [H, Lq, D]
            ks = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, D]
            vs = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * scale  # [H, Lq, Lk]
            if bias is not None:
                key_positions = torch.arange(len_k, device=q.device)
                scores = scores + bias.bias(key_positions[len_k - len_q :], key_positions, table)
            if disentangled is not None:
                key_positions = torch.arange(len_k, device=q.device)
                rows_ij = disentangled.rows(rows_table, key_positions[len_k - len_q :], key_positions)
                scores = scores + _disentangled_scores(qs, ks, positions, rows_ij) * scale
            if meta.is_causal or layer.sliding_window is not None:
                seen = visible_keys(len_q, len_k, meta.is_causal, layer.sliding_window, q.device)
                scores = scores.masked_fill(~seen, float("-inf"))
            out[rows] = (scores.softmax(dim=-1) @ vs).transpose(0, 1).to(q.dtype)
            q_start += len_q
            k_start += len_k
        return out


def _disentangled_scores(qs, ks, positions: PositionProjections, rows: torch.Tensor) -> torch.Tensor:
    """[H, Lq, Lk]: q_i . pos_key[rows[i, j]] + k_j . pos_query[rows[i, j]] (qs, ks: [H, L, D])."""
    scores = qs.new_zeros(qs.shape[0], *rows.shape)
    if positions.keys is not None:
        scores += torch.einsum("hid,ijhd->hij", qs, positions.keys.float()[rows])
    if positions.queries is not None:
        scores += torch.einsum("hjd,ijhd->hij", ks, positions.queries.float()[rows])
    return scores


def read_sequence(
    kv_cache: torch.Tensor, common: CommonAttentionMetadata, seq: int, len_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first len_k keys and values of sequence `seq`: its blocks, in table order, cut at len_k."""
    _, _, block_size, kv_heads, size = kv_cache.shape
    table = common.block_tables[seq, : -(-len_k // block_size)].long()
    keys = kv_cache[0][table].reshape(-1, kv_heads, size)[:len_k]
    values = kv_cache[1][table].reshape(-1, kv_heads, size)[:len_k]
    return keys, values


def future_mask(len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """[len_q, len_k] bool, True where a key lies after the query: queries are the last len_q keys."""
    return torch.ones(len_q, len_k, dtype=torch.bool, device=device).triu(len_k - len_q + 1)
