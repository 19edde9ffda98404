"""Turns a StepBatch into flat device tensors with one host-to-device copy.

Layout: every sequence's tokens of this step one after another, `[num_tokens]`, longest first, with
`cu_seqlens` marking the starts. A sequence's tokens sit at positions start_position.. of it (0.. without
a KV cache). All integers of a step go into one int64 host buffer (pinned on CUDA), cross in one
non-blocking copy, and are sliced apart on the device: ids, positions, offsets, pooling indices, sampled
rows, and per KV-cache group the slot of every new token and the block tables [num_seqs, max_blocks].
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from embedserv.attention.metadata import (
    CommonAttentionMetadata,
    build_common_metadata,
    build_paged_metadata,
    cumulative_offsets,
)
from embedserv.models.heads import PoolingInputs
from embedserv.types import OutputKind, SamplingParams, ScheduledSequence, StepBatch


@dataclass(frozen=True)
class ModelInputs:
    # [num_tokens] int64
    input_ids: torch.Tensor
    # [num_tokens] int64, already shifted by the model's position offset
    positions: torch.Tensor
    # [num_tokens] int64, or None when every token is type 0
    token_type_ids: torch.Tensor | None
    # One per KV-cache group; one KV-free entry when the step keeps no KV.
    attention: tuple[CommonAttentionMetadata, ...]
    # Rows for POOL / SCORE sequences (None when none yields a row), in batch order.
    pooling: PoolingInputs | None
    row_request_ids: tuple[int, ...]
    # [num_samples] int64: the rows whose hidden state predicts the next token; None when none samples.
    sample_rows: torch.Tensor | None
    sampled_request_ids: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    # Tokens known when each row samples (the sampler seeds by it).
    sample_lengths: tuple[int, ...]
    # Per KV-cache group, the host copy of the block tables [num_seqs, max_blocks] (empty without KV).
    block_tables_cpu: tuple[np.ndarray, ...] = ()


class InputBuilder:
    def __init__(self, device: torch.device, position_offset: int, is_causal: bool, block_size: int = 0) -> None:
        self.device = device
        self.position_offset = position_offset
        self.is_causal = is_causal
        self.block_size = block_size

    def build(self, batch: StepBatch) -> ModelInputs:
        seqs = batch.sequences
        lens_q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=len(seqs))
        # Longest first, so equal lengths sit side by side: backends that split by length (sdpa) then work
        # on contiguous runs. Outputs stay in batch order through the pooling and sampling indices.
        order = np.argsort(-lens_q, kind="stable")
        packed_lens = lens_q[order]
        num_tokens = int(packed_lens.sum())
        cu = cumulative_offsets(packed_lens)
        packed_start = np.empty(len(seqs), dtype=np.int64)
        packed_start[order] = cu[:-1]
        pos_in_step = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], packed_lens)
        positions = pos_in_step + np.repeat(starts[order], packed_lens)
        parts = [
            np.fromiter(chain.from_iterable(seqs[i].token_ids for i in order), dtype=np.int64, count=num_tokens),
            positions + self.position_offset,
            cu,
        ]
        rows = [i for i, s in enumerate(seqs) if s.produces_output and s.output is not OutputKind.SAMPLE]
        samples = [i for i, s in enumerate(seqs) if s.produces_output and s.output is OutputKind.SAMPLE]
        pooling = _PoolingPlan(seqs, rows, packed_start, lens_q, order, pos_in_step) if rows else None
        if pooling is not None:
            parts += pooling.parts
        if samples:
            parts.append(packed_start[samples] + lens_q[samples] - 1)
        has_types = any(s.token_type_ids is not None for s in seqs)
        if has_types:
            parts.append(_token_types([seqs[i] for i in order], num_tokens))
        paged = _PagedPlan(seqs, order, positions, self.block_size) if batch.uses_kv_cache else None
        if paged is not None:
            parts += paged.parts
        device_parts = iter(to_device(parts, self.device))
        input_ids, positions_t, cu_t = next(device_parts), next(device_parts), next(device_parts)
        pooling_inputs = pooling.inputs(device_parts) if pooling is not None else None
        sample_rows = next(device_parts) if samples else None
        token_type_ids = next(device_parts) if has_types else None
        lens_k = packed_lens + starts[order]
        if paged is not None:
            attention = paged.metadata(device_parts, packed_lens, lens_k, cu_t)
        else:
            attention = (build_common_metadata(packed_lens, self.is_causal, cu_seqlens=cu_t),)
        return ModelInputs(
            input_ids=input_ids,
            positions=positions_t,
            token_type_ids=token_type_ids,
            attention=attention,
            pooling=pooling_inputs,
            row_request_ids=tuple(seqs[i].request_id for i in rows),
            sample_rows=sample_rows,
            sampled_request_ids=tuple(seqs[i].request_id for i in samples),
            sampling=tuple(seqs[i].sampling for i in samples),
            sample_lengths=tuple(int(starts[i] + lens_q[i]) for i in samples),
            block_tables_cpu=tuple(paged.tables_cpu) if paged is not None else (),
        )


class _PoolingPlan:
    """Where each row sequence's pooled tokens are in the packed batch."""

    def __init__(self, seqs, rows: list[int], packed_start, lens_q, order, pos_in_step) -> None:
        lens = lens_q[rows]
        starts = packed_start[rows]
        pool_start = np.fromiter((min(seqs[i].pool_start, len(seqs[i].token_ids) - 1) for i in rows), np.int64)
        self.parts = [starts + pool_start, starts + lens - 1, lens - pool_start]
        # Row index of each packed token's sequence (-1: a sequence without a row).
        row_of_seq = np.full(len(seqs), -1, dtype=np.int64)
        row_of_seq[rows] = np.arange(len(rows))
        token_row = np.repeat(row_of_seq[order], lens_q[order])
        pool_from = np.zeros(len(seqs), dtype=np.int64)
        pool_from[rows] = pool_start
        counted = (token_row >= 0) & (pos_in_step >= np.repeat(pool_from[order], lens_q[order]))
        self.every_token_counts = bool(counted.all())
        if self.every_token_counts:
            self.parts.append(token_row)
        else:
            self.parts += [np.flatnonzero(counted), token_row[counted]]

    def inputs(self, device_parts) -> PoolingInputs:
        first, last, counts = next(device_parts), next(device_parts), next(device_parts)
        token_index = None if self.every_token_counts else next(device_parts)
        return PoolingInputs(
            first_index=first,
            last_index=last,
            token_index=token_index,
            token_seq=next(device_parts),
            token_count=counts.float(),
        )


class _PagedPlan:
    """Per KV-cache group: the new tokens' slots and the block tables, in packed order."""

    def __init__(self, seqs, order, positions: np.ndarray, block_size: int) -> None:
        num_groups = len(seqs[0].block_ids)
        self.block_size = block_size
        self.num_seqs = len(seqs)
        self.parts: list[np.ndarray] = []
        self.widths: list[int] = []
        self.tables_cpu: list[np.ndarray] = []
        seq_of_token = np.repeat(np.arange(len(seqs)), [len(seqs[i].token_ids) for i in order])
        for group in range(num_groups):
            tables = [seqs[i].block_ids[group] for i in order]
            width = max(1, max(len(t) for t in tables))
            padded = np.zeros((len(tables), width), dtype=np.int64)
            for row, table in enumerate(tables):
                padded[row, : len(table)] = table
            slots = padded[seq_of_token, positions // block_size] * block_size + positions % block_size
            self.parts += [slots, padded.reshape(-1)]
            self.tables_cpu.append(padded)
            self.widths.append(width)

    def metadata(self, device_parts, lens_q, lens_k, cu_q) -> tuple[CommonAttentionMetadata, ...]:
        lens_k_t = None
        out = []
        for width in self.widths:
            slots, tables = next(device_parts), next(device_parts)
            if lens_k_t is None:
                lens_k_t = torch.from_numpy(lens_k).to(cu_q.device)
                cu_k = torch.from_numpy(cumulative_offsets(lens_k)).to(cu_q.device)
            out.append(build_paged_metadata(
                lens_q, lens_k, cu_q, cu_k, slots, tables.view(self.num_seqs, width), lens_k_t, self.block_size
            ))
        return tuple(out)


def _token_types(seqs: list[ScheduledSequence], num_tokens: int) -> np.ndarray:
    for s in seqs:
        # fromiter below would silently shift every later sequence's types.
        if s.token_type_ids is not None and len(s.token_type_ids) != len(s.token_ids):
            raise ValueError(f"{len(s.token_type_ids)} token type ids for {len(s.token_ids)} tokens")
    types = chain.from_iterable(
        s.token_type_ids if s.token_type_ids is not None else [0] * len(s.token_ids) for s in seqs
    )
    return np.fromiter(types, dtype=np.int64, count=num_tokens)


def to_device(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays -> device tensors, through one (pinned, non-blocking) copy."""
    sizes = [len(p) for p in parts]
    host = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    if device.type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.split(sizes))
