"""T5's relative position bias for the sdpa backend, as float masks added to the scores: one per KV-free
run length, paged chunk or decode batch, made by the step's first layer of a stack and kept in the step's
metadata (keyed by the stack's bias module) for the others. -inf where causal attention hides a key.

DeBERTa's disentangled bias depends on each layer's queries and keys: every layer makes its own, one
[n, heads, L, L] mask per group of sequences of a run (attention/disentangled.py); only the embedding
row of each pair is shared by the step's layers."""

from __future__ import annotations

import torch

from embedserv.attention.backends.base import AttentionLayer, step_memo
from embedserv.attention.backends.naive import future_mask
from embedserv.attention.backends.sdpa_runs import Run, SdpaMetadata
from embedserv.attention.disentangled import PositionProjections, content_position_scores, sequence_bias


def mask_dtype(q: torch.Tensor) -> torch.dtype:
    """A float mask's dtype: float32 on CPU, where SDPA takes it with bfloat16 queries and is the more
    exact for it (rounding T5's bias to bfloat16 moved outputs by up to 0.04), and the matmuls add it
    and softmax in float32; q's elsewhere, what the CUDA kernels take."""
    return torch.float32 if q.device.type == "cpu" else q.dtype


def run_bias(
    layer: AttentionLayer, table: torch.Tensor, meta: SdpaMetadata, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """[1, heads, length, length]: the bias of a KV-free run (every sequence of it alike), causal included."""
    bias = layer.relative_bias

    def make() -> torch.Tensor:
        positions = torch.arange(length, device=table.device)
        mask = bias.bias(positions, positions, table)
        if meta.is_causal:
            mask = mask.masked_fill(future_mask(length, length, table.device), float("-inf"))
        return mask.to(dtype).unsqueeze(0)

    return step_memo(meta.memo, ("run", bias, length, dtype), make)


def chunk_bias(
    layer: AttentionLayer, table: torch.Tensor, meta: SdpaMetadata, index: int, dtype: torch.dtype
) -> torch.Tensor:
    """[1, heads, len_q, len_k]: the bias of paged chunk `index`, its queries the last len_q positions."""
    bias, chunk = layer.relative_bias, meta.paged.chunks[index]

    def make() -> torch.Tensor:
        keys = torch.arange(chunk.len_k, device=table.device)
        mask = bias.bias(keys[chunk.len_k - chunk.len_q :], keys, table)
        if chunk.causal:
            mask = mask.masked_fill(future_mask(chunk.len_q, chunk.len_k, table.device), float("-inf"))
        return mask.to(dtype).unsqueeze(0)

    return step_memo(meta.memo, ("chunk", bias, index, dtype), make)


def decode_bias(layer: AttentionLayer, table: torch.Tensor, meta: SdpaMetadata, dtype: torch.dtype) -> torch.Tensor:
    """[num_decodes, heads, 1, blocks * block_size]: each decode's bias over its keys, -inf past its length."""
    bias, plan = layer.relative_bias, meta.paged

    def make() -> torch.Tensor:
        limit = bias.max_distance
        keys = torch.arange(plan.decode_mask.shape[-1], device=table.device)
        distance = (keys[None, :] - plan.decode_positions[:, None]).clamp(-limit, limit) + limit
        mask = table[:, distance].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, L]
        return mask.masked_fill(~plan.decode_mask, float("-inf")).to(dtype)

    return step_memo(meta.memo, ("decode", bias, dtype), make)


# A disentangled mask (and each of its two score terms) of a group of sequences stays under this many
# bytes: a run of long sequences is cut into groups rather than materialized at once.
_DISENTANGLED_BYTES = 64 << 20


def disentangled_groups(run: Run, heads: int) -> list[Run]:
    """`run` cut into consecutive groups whose [n, heads, L, L] float32 mask fits _DISENTANGLED_BYTES."""
    per_group = max(1, _DISENTANGLED_BYTES // (heads * run.length * run.length * 4))
    return [
        Run(
            token_start=run.token_start + first * run.length,
            num_seqs=min(per_group, run.num_seqs - first),
            length=run.length,
        )
        for first in range(0, run.num_seqs, per_group)
    ]


def disentangled_bias(
    layer: AttentionLayer, q, k, positions: PositionProjections, meta: SdpaMetadata, run: Run, dtype: torch.dtype
) -> torch.Tensor:
    """[num_seqs, heads, L, L]: the disentangled bias of the run's sequences, from their rows q, k."""
    disentangled, length = layer.disentangled, run.length

    def rows() -> torch.Tensor:
        table = step_memo(meta.memo, ("disentangled-table", disentangled), lambda: disentangled.index_table(q.device))
        positions_ = torch.arange(length, device=q.device)
        return disentangled.rows(table, positions_, positions_)

    shape = (run.num_seqs, length, *q.shape[1:])
    c2p, p2c = content_position_scores(q.view(shape), k.view(shape), positions, layer.scale)
    pairs = step_memo(meta.memo, ("disentangled-rows", disentangled, length), rows)
    return sequence_bias(c2p, p2c, pairs).to(dtype)
