"""DeBERTa-v2/v3's disentangled attention: a score bias from relative position embeddings and content.

Besides q_i . k_j, a DeBERTa layer scores the query against the position key of the pair's relative
position ("c2p": q_i . pos_key[r(i, j)]) and the key against its position query ("p2c":
k_j . pos_query[r(i, j)]), all three times the layer's scale 1 / sqrt(head_size * (1 + number of terms)).
r(i, j) is a row of the [2 * span, hidden] relative embeddings: the (log-)bucketed distance i - j,
shifted by span and clamped to the table (transformers' make_log_bucket_position and clamp).

Unlike T5's bias this depends on each token's content, so it is not one table: the model projects the
relative embeddings through its layer's position projections once per forward pass and hands them to the
Attention call (`PositionProjections`, [2 * span, heads, head_size] each); the backends turn them into
each sequence's bias. The row of a distance no longer changes past `max_distance` (either side clamps to
the table's first or last row), so `index_table()` maps every distance in [-max_distance, max_distance]
to its row and longer ones are clamped to it, as T5's distance table is.

Only encoders use it: KV-free self-attention, never causal, without a sliding window (the selector and
the backends refuse the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def log_bucket_position(relative: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """transformers' make_log_bucket_position, op for op (the float rounding decides the buckets)."""
    sign = torch.sign(relative)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative < mid) & (relative > -mid), torch.tensor(mid - 1).type_as(relative), torch.abs(relative)
    )
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).long()


@dataclass(frozen=True)
class DisentangledPositions:
    """How a DeBERTa layer indexes its relative embeddings; every layer of a model holds an equal one."""

    # config.position_buckets (<= 0: no log buckets) and max_relative_positions (already defaulted to
    # max_position_embeddings when < 1, as transformers does).
    position_buckets: int
    max_relative_positions: int

    @property
    def span(self) -> int:
        """Half the rows of the relative embeddings (transformers' att_span / pos_ebd_size)."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def max_distance(self) -> int:
        """From this |i - j| on, the row is the table's first or last (see the module docstring)."""
        return max(self.max_relative_positions, self.span)

    def index_table(self, device: torch.device) -> torch.Tensor:
        """[2 * max_distance + 1] int64: the embedding row r of distance d = i - j at d + max_distance."""
        distance = torch.arange(-self.max_distance, self.max_distance + 1, device=device)
        if self.position_buckets > 0:
            distance = log_bucket_position(distance, self.position_buckets, self.max_relative_positions)
        return (distance + self.span).clamp(0, 2 * self.span - 1)

    def rows(self, table: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[len(query_positions), len(key_positions)] int64: the embedding row of each pair."""
        distance = (query_positions[:, None] - key_positions[None, :]).clamp(-self.max_distance, self.max_distance)
        return table[distance + self.max_distance]


@dataclass(frozen=True)
class PositionProjections:
    """One Attention call's position projections of the relative embeddings, [2 * span, heads, head_size]
    each; None for a term the layer does not use (pos_att_type)."""

    # Multiplied by the queries (c2p).
    keys: torch.Tensor | None
    # Multiplied by the keys (p2c).
    queries: torch.Tensor | None


def content_position_scores(
    q: torch.Tensor, k: torch.Tensor, projections: PositionProjections, scale: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """q [..., Lq, H, d], k [..., Lk, H, d] -> (c2p, p2c): every query's and key's scaled score against
    every embedding row, [..., H, Lq or Lk, 2 * span] float32 (None for an absent term)."""
    c2p = p2c = None
    if projections.keys is not None:
        c2p = torch.einsum("...qhd,rhd->...hqr", q.float(), projections.keys.float()) * scale
    if projections.queries is not None:
        p2c = torch.einsum("...khd,rhd->...hkr", k.float(), projections.queries.float()) * scale
    return c2p, p2c


def sequence_bias(c2p: torch.Tensor | None, p2c: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """The [..., H, Lq, Lk] float32 bias of sequences of one length from content_position_scores;
    `rows` [Lq, Lk]: DisentangledPositions.rows of their positions."""
    bias = None
    if c2p is not None:
        # c2p[..., h, i, rows[i, j]]
        bias = torch.gather(c2p, -1, rows.expand(*c2p.shape[:-1], rows.shape[1]))
    if p2c is not None:
        # p2c[..., h, j, rows[i, j]], gathered along the keys' rows, then turned to [.., i, j].
        term = torch.gather(p2c, -1, rows.t().expand(*p2c.shape[:-1], rows.shape[0])).transpose(-1, -2)
        bias = term if bias is None else bias + term
    return bias


def refuse_disentangled(layer, backend: str, where: str) -> None:
    """For the paths no DeBERTa step takes (paged, cross-attention, suffix queries, causal): reaching one
    with a disentangled layer is a bug, not a wrong answer."""
    if getattr(layer, "disentangled", None) is not None:
        raise NotImplementedError(
            f"attention layer {layer.layer_index}: the {backend} attention backend does not add DeBERTa's "
            f"disentangled position bias to {where}"
        )
