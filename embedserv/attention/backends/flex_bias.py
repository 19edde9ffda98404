"""The flex backend's score_mods: T5's relative position bias and DeBERTa's disentangled bias, and the
packed positions both index by. Their tables and scores are inputs of the compiled kernel, not constants,
so a new step compiles nothing."""

from __future__ import annotations

import torch

from embedserv.attention.backends.base import AttentionLayer, step_memo
from embedserv.attention.disentangled import PositionProjections, content_position_scores


def relative_bias_mod(table: torch.Tensor, max_distance: int, q_pos: torch.Tensor, key_position):
    """score_mod adding T5's bias: table[h, clamp(key - query position, -M, M) + M]. `key_position(kv)`
    maps a key index to its position in its sequence (packed rows or paged cache slots)."""

    def biased(score, b, h, q, kv):
        distance = (key_position(kv) - q_pos[q]).clamp(-max_distance, max_distance)
        return score + table[h, distance + max_distance]

    return biased


def packed_positions(meta) -> torch.Tensor:
    """[padded_tokens] int64: each packed row's position in its sequence; padding rows get rows past the
    end (never seen). Once per step."""

    def positions() -> torch.Tensor:
        cu = meta.common.cu_seqlens_q.long()
        rows = torch.arange(meta.padded_tokens, device=cu.device)
        return rows - cu[meta.documents.long()]

    return step_memo(meta.memo, "positions", positions)


def disentangled_mod(layer: AttentionLayer, meta, qb, kb, positions: PositionProjections):
    """KV-free self-attention's disentangled score_mod: score + c2p[h, q, row] + p2c[h, kv, row], row the
    embedding row of the pair's distance. qb, kb: [1, heads, padded, d] as the kernel takes them."""
    disentangled = layer.disentangled
    limit = disentangled.max_distance
    table = step_memo(meta.memo, ("disentangled-table", disentangled), lambda: disentangled.index_table(qb.device))
    pos = packed_positions(meta)
    c2p, p2c = content_position_scores(qb[0].transpose(0, 1), kb[0].transpose(0, 1), positions, layer.scale)
    c2p = None if c2p is None else c2p.detach()
    p2c = None if p2c is None else p2c.detach()

    def row(q, kv):
        return table[(pos[q] - pos[kv]).clamp(-limit, limit) + limit]

    # One function per set of terms (pos_att_type): the compiled kernel takes no None inputs.
    if p2c is None:
        return lambda score, b, h, q, kv: score + c2p[h, q, row(q, kv)]
    if c2p is None:
        return lambda score, b, h, q, kv: score + p2c[h, kv, row(q, kv)]
    return lambda score, b, h, q, kv: score + c2p[h, q, row(q, kv)] + p2c[h, kv, row(q, kv)]
