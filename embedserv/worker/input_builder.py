"""Turns a StepBatch into flat device tensors with one host-to-device copy.

Layout: every sequence's tokens of this step one after another, `[num_tokens]`, longest first, with
`cu_seqlens` marking the starts. A sequence's tokens sit at positions start_position.. of it (0.. without
a KV cache). All integers of a step go into one int64 host buffer (pinned on CUDA), cross in one
non-blocking copy, and are sliced apart on the device: ids, positions, offsets, pooling indices, sampled
rows, and per KV-cache group the slot of every new token and the block tables [num_seqs, max_blocks].

On CPU the rows are padded to a bounded set of counts (embedserv/padding.py); padding rows come after the
real ones and belong to no sequence.

Encoder-decoder steps also carry the encoder inputs of the sequences whose encoder runs now, packed in
the decoder's sequence order with their own offsets (the encoder's metadata); cross-attention reads, per
sequence, its encoder's keys: packed ones on KV-free steps, its cross block table on paged ones (where
the new encoder tokens' slots are that group's slot mapping). Such steps order sequences by decoder
length, then encoder length, so that equal shapes sit together.
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
from embedserv.models.heads.pooling import PoolingInputs, TokenInputs
from embedserv.models.lora import AdapterRows, adapter_rows
from embedserv.padding import pad, padded_rows
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
from embedserv.types import EmbedOutput, SamplingParams
from embedserv.worker.encoder_inputs import EncoderPlan
from embedserv.worker.image_inputs import ImagePlan
from embedserv.worker.prefill_skip import SkipPlan


@dataclass(frozen=True)
class ModelInputs:
    # [padded] int64: the step's num_tokens token ids, then padding rows (id 0) up to the padded count
    # (equal to num_tokens where rows are not padded: off CPU)
    input_ids: torch.Tensor
    # [padded] int64, already shifted by the model's position offset (padding rows: position 0)
    positions: torch.Tensor
    # [padded] int64, or None when every token is type 0
    token_type_ids: torch.Tensor | None
    # [padded] int64: each token's task adapter (-1 for none, and for padding rows); None when no token has one
    adapter_ids: torch.Tensor | None
    # --lora models instead: each adapter's rows (models/lora.py); None when every row runs the base.
    adapter_rows: AdapterRows | None
    # One per KV-cache group; one KV-free entry when the step keeps no KV.
    attention: tuple[CommonAttentionMetadata, ...]
    # Rows for POOL / SCORE sequences (None when none yields a row), in batch order.
    pooling: PoolingInputs | None
    row_request_ids: tuple[int, ...]
    # Each row's adapter (Sequence.adapter), in the same order: --lora adapters' own heads pick by it.
    row_adapters: tuple[int, ...]
    # [num_samples, padded on CPU] int64: the rows whose hidden state predicts the next token (padding: row 0
    # again); None when none samples.
    sample_rows: torch.Tensor | None
    sampled_request_ids: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    # Tokens known when each row samples (the sampler seeds by it).
    sample_lengths: tuple[int, ...]
    # Per KV-cache group, the host copy of the block tables [num_seqs, max_blocks] (empty without KV).
    block_tables_cpu: tuple[np.ndarray, ...] = ()
    # Encoder-decoder steps: the encoder inputs run now ([num_encoder_tokens, padded on CPU] ids and shifted
    # positions) and their metadata; None when no encoder runs.
    encoder_input_ids: torch.Tensor | None = None
    encoder_positions: torch.Tensor | None = None
    encoder_attention: CommonAttentionMetadata | None = None
    # KV-free encoder-decoder steps: the decoder's queries over the packed encoder keys.
    cross_attention: CommonAttentionMetadata | None = None
    # --kv-sharing-fast-prefill (worker/prefill_skip.py): the rows the layers after the last KV writer
    # run, and their metadata per group; None when every row runs every layer. Pooling and sample rows
    # then index the kept rows.
    skip_rows: torch.Tensor | None = None
    skip_attention: tuple[CommonAttentionMetadata, ...] | None = None
    # POOL sequences that want a sparse or a per-token output: their tokens; None when none does.
    sparse_tokens: TokenInputs | None = None
    vector_tokens: TokenInputs | None = None
    # Rows of the model's output that are real (the step's tokens, or the prefill skip's kept rows); the
    # padding rows after them are dropped before the heads. None: every row is real.
    num_output_rows: int | None = None
    # Image sequences (worker/image_inputs.py): their patch rows [rows, patch_dim] float32 in packed order, their
    # grids, and the vision tower's metadata; None / () when the step has no image.
    pixel_values: torch.Tensor | None = None
    image_grids: tuple[tuple[int, ...], ...] = ()
    vision_attention: CommonAttentionMetadata | None = None


class InputBuilder:
    def __init__(
        self, device: torch.device, position_offset: int, is_causal: bool, block_size: int = 0,
        fixed_groups: tuple[bool, ...] = (), is_encoder_decoder: bool = False, prefill_skip: bool = False,
        rows_read_last: bool = False, pad_rows: bool = False, lora: bool = False, token_types: bool = False,
        task_adapters: bool = False,
    ) -> None:
        self.device = device
        self.position_offset = position_offset
        self.is_causal = is_causal
        self.block_size = block_size
        # Per KV-cache group: True for a fixed (cross-attention) group.
        self.fixed_groups = fixed_groups
        self.is_encoder_decoder = is_encoder_decoder
        # Plan the prefill skip; `rows_read_last`: the row head reads only each sequence's last token.
        self.prefill_skip = prefill_skip
        self.rows_read_last = rows_read_last
        # Pad the model's rows to padded_rows() (CPU: oneDNN keeps state per row count).
        self.padded = padded_rows if pad_rows else _unpadded
        # --lora adapters: rows per adapter (AdapterRows) instead of per-token adapter ids.
        self.lora = lora
        # The model reads token types; it has built-in task adapters (per-token adapter ids).
        self.token_types = token_types
        self.task_adapters = task_adapters

    def build(self, batch: StepBatch) -> ModelInputs:
        seqs = batch.sequences
        lens_q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=len(seqs))
        # Longest first, so equal lengths sit side by side: backends that split by length (sdpa) then work
        # on contiguous runs. Outputs stay in batch order through the pooling and sampling indices.
        if self.is_encoder_decoder:
            lens_e = np.fromiter((s.encoder_len for s in seqs), dtype=np.int64, count=len(seqs))
            order = np.lexsort((-lens_e, -lens_q))
        elif self.lora:
            # --lora: each adapter's sequences side by side (longest first within), one run of rows each.
            order = np.lexsort((-lens_q, np.fromiter((s.adapter for s in seqs), dtype=np.int64, count=len(seqs))))
        else:
            order = np.argsort(-lens_q, kind="stable")
        packed_lens = lens_q[order]
        num_tokens = int(packed_lens.sum())
        cu = cumulative_offsets(packed_lens)
        packed_start = np.empty(len(seqs), dtype=np.int64)
        packed_start[order] = cu[:-1]
        pos_in_step = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], packed_lens)
        positions = pos_in_step + np.repeat(starts[order], packed_lens)
        lens_k = packed_lens + starts[order]
        padded = self.padded(num_tokens)
        parts = [
            pad(np.fromiter(chain.from_iterable(seqs[i].token_ids for i in order), np.int64, count=num_tokens), padded),
            pad(positions, padded) + self.position_offset,
            cu,
        ]
        rows = [i for i, s in enumerate(seqs) if s.produces_output and _wants_row(s)]
        token_plans = {
            kind: _TokenPlan(seqs, members, packed_start, lens_q)
            for kind in (EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR)
            if (members := [i for i, s in enumerate(seqs) if s.output is OutputKind.POOL and kind in s.outputs])
        }
        samples = [i for i, s in enumerate(seqs) if s.produces_output and s.output is OutputKind.SAMPLE]
        # Where outputs read their rows: the packed batch, or the rows the prefill skip keeps.
        out_start, out_len, dropped, out_pos = packed_start, lens_q, np.zeros(len(seqs), np.int64), pos_in_step
        skip = None
        if self.prefill_skip:
            skip = SkipPlan(seqs, order, packed_lens, lens_k, self.rows_read_last, batch.uses_kv_cache, self.padded)
            if skip.active:
                parts += skip.parts
                out_start, out_len, dropped, out_pos = skip.out_start, skip.out_len, skip.dropped, skip.pos_in_step()
            else:
                skip = None
        pooling = _PoolingPlan(seqs, rows, out_start, out_len, order, out_pos, dropped) if rows else None
        if pooling is not None:
            parts += pooling.parts
        if samples:
            # Padding rows sample row 0 again (the LM head runs a bounded set of row counts); dropped after.
            parts.append(pad(out_start[samples] + out_len[samples] - 1, self.padded(len(samples))))
        for plan in token_plans.values():
            if skip is not None:
                raise ValueError("per-token outputs need every row; they cannot run with the prefill skip")
            parts += plan.parts
        has_types = self.token_types and any(s.token_type_ids is not None for s in seqs)
        if has_types:
            parts.append(pad(_token_types([seqs[i] for i in order], num_tokens), padded))
        has_adapters = self.task_adapters and any(s.adapter >= 0 for s in seqs)
        if has_adapters:
            # Shifted by one around pad() so that padding rows get -1 (no adapter) rather than adapter 0.
            parts.append(pad(np.repeat([seqs[i].adapter + 1 for i in order], packed_lens), padded) - 1)
        encoder = EncoderPlan(seqs, order, self.position_offset, self.padded) if self.is_encoder_decoder else None
        if encoder is not None:
            parts += encoder.parts
        images = ImagePlan(seqs, order, self.padded) if ImagePlan.wanted(seqs) else None
        if images is not None:
            parts += images.parts
        paged = None
        if batch.uses_kv_cache:
            paged = _PagedPlan(seqs, order, positions, self.block_size, self.fixed_groups, encoder)
            parts += paged.parts
        device_parts = iter(to_device(parts, self.device))
        input_ids, positions_t, cu_t = next(device_parts), next(device_parts), next(device_parts)
        skip_parts = [next(device_parts) for _ in skip.parts] if skip is not None else None
        pooling_inputs = pooling.inputs(device_parts) if pooling is not None else None
        sample_rows = next(device_parts) if samples else None
        tokens = {kind: plan.inputs(device_parts) for kind, plan in token_plans.items()}
        token_type_ids = next(device_parts) if has_types else None
        adapter_ids = next(device_parts) if has_adapters else None
        lora = adapter_rows(np.array([seqs[i].adapter for i in order]), packed_lens) if self.lora else None
        encoder_inputs = encoder.inputs(device_parts) if encoder is not None else (None, None, None)
        pixels, vision = images.inputs(device_parts, self.device) if images is not None else (None, None)
        cross = None
        if paged is not None:
            attention = paged.metadata(device_parts, packed_lens, lens_k, cu_t)
        else:
            attention = (build_common_metadata(packed_lens, self.is_causal, cu_seqlens=cu_t),)
            if encoder is not None:
                cross = encoder.kv_free_cross(packed_lens, cu_t, encoder_inputs[2])
        skip_rows = skip_attention = None
        if skip is not None:
            skip_rows, skip_attention = skip.metadata(iter(skip_parts), attention, self.is_causal)
        return ModelInputs(
            input_ids=input_ids,
            positions=positions_t,
            token_type_ids=token_type_ids,
            adapter_ids=adapter_ids,
            adapter_rows=lora,
            attention=attention,
            pooling=pooling_inputs,
            row_request_ids=tuple(seqs[i].request_id for i in rows),
            row_adapters=tuple(seqs[i].adapter for i in rows),
            sample_rows=sample_rows,
            sampled_request_ids=tuple(seqs[i].request_id for i in samples),
            sampling=tuple(seqs[i].sampling for i in samples),
            sample_lengths=tuple(int(starts[i] + lens_q[i]) for i in samples),
            block_tables_cpu=tuple(paged.tables_cpu) if paged is not None else (),
            encoder_input_ids=encoder_inputs[0],
            encoder_positions=encoder_inputs[1],
            encoder_attention=encoder_inputs[2],
            cross_attention=cross,
            skip_rows=skip_rows,
            skip_attention=skip_attention,
            sparse_tokens=tokens.get(EmbedOutput.SPARSE),
            vector_tokens=tokens.get(EmbedOutput.MULTI_VECTOR),
            num_output_rows=skip.num_kept_rows if skip is not None else num_tokens,
            pixel_values=pixels,
            image_grids=images.grids if images is not None else (),
            vision_attention=vision,
        )


def _unpadded(num_rows: int) -> int:
    return num_rows


def _wants_row(seq: ScheduledSequence) -> bool:
    """SCORE sequences, and POOL ones that want the dense vector."""
    wants_dense = not seq.outputs or EmbedOutput.DENSE in seq.outputs
    return seq.output is OutputKind.SCORE or (seq.output is OutputKind.POOL and wants_dense)


class _TokenPlan:
    """Every token of the `members` sequences (in batch order) for a per-token output."""

    def __init__(self, seqs, members: list[int], packed_start, lens_q) -> None:
        lens = lens_q[members]
        cu = cumulative_offsets(lens)
        self.request_ids = tuple(seqs[i].request_id for i in members)
        self.lengths = lens
        total = int(cu[-1])
        rows = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - packed_start[members], lens)
        seq = np.repeat(np.arange(len(members), dtype=np.int64), lens)
        ids = np.fromiter(chain.from_iterable(seqs[i].token_ids for i in members), dtype=np.int64, count=total)
        self.parts = [rows, seq, ids]

    def inputs(self, device_parts) -> TokenInputs:
        rows, seq, ids = next(device_parts), next(device_parts), next(device_parts)
        return TokenInputs(rows, seq, ids, self.request_ids, self.lengths)


class _PoolingPlan:
    """Where each row sequence's pooled tokens are among the rows the head reads: the packed batch, or the
    rows the prefill skip keeps (`dropped`: tokens of each sequence left out in front)."""

    def __init__(self, seqs, rows: list[int], packed_start, lens_q, order, pos_in_step, dropped) -> None:
        lens = lens_q[rows]
        starts = packed_start[rows]
        pool_start = np.fromiter(
            (max(0, min(seqs[i].pool_start, len(seqs[i].token_ids) - 1) - dropped[i]) for i in rows), np.int64
        )
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
    """Per KV-cache group: the new tokens' slots and the block tables, in packed order.

    A fixed (cross) group's new tokens are this step's encoder tokens, and its keys are each sequence's
    whole encoder input."""

    def __init__(self, seqs, order, positions: np.ndarray, block_size: int, fixed_groups, encoder) -> None:
        num_groups = len(seqs[0].block_ids)
        self.block_size = block_size
        self.num_seqs = len(seqs)
        self.parts: list[np.ndarray] = []
        self.widths: list[int] = []
        self.tables_cpu: list[np.ndarray] = []
        self.fixed = [bool(fixed_groups[g]) if g < len(fixed_groups) else False for g in range(num_groups)]
        seq_of_token = np.repeat(np.arange(len(seqs)), [len(seqs[i].token_ids) for i in order])
        if any(self.fixed):
            self.encoder_lens = np.fromiter((seqs[i].encoder_len for i in order), dtype=np.int64, count=len(seqs))
            seq_of_encoder_token = np.repeat(encoder.members, encoder.lens)
        for group in range(num_groups):
            tables = [seqs[i].block_ids[group] for i in order]
            width = max(1, max(len(t) for t in tables))
            padded = np.zeros((len(tables), width), dtype=np.int64)
            for row, table in enumerate(tables):
                padded[row, : len(table)] = table
            if self.fixed[group]:
                rows, at = seq_of_encoder_token, encoder.positions
            else:
                rows, at = seq_of_token, positions
            slots = padded[rows, at // block_size] * block_size + at % block_size
            self.parts += [slots, padded.reshape(-1)]
            self.tables_cpu.append(padded)
            self.widths.append(width)

    def metadata(self, device_parts, lens_q, lens_k, cu_q) -> tuple[CommonAttentionMetadata, ...]:
        device = cu_q.device
        by_lengths: dict[bool, tuple] = {}
        out = []
        for width, fixed in zip(self.widths, self.fixed):
            slots, tables = next(device_parts), next(device_parts)
            if fixed not in by_lengths:
                keys = self.encoder_lens if fixed else lens_k
                by_lengths[fixed] = (
                    keys, torch.from_numpy(keys).to(device), torch.from_numpy(cumulative_offsets(keys)).to(device)
                )
            keys, keys_t, cu_k = by_lengths[fixed]
            out.append(build_paged_metadata(
                lens_q, keys, cu_q, cu_k, slots, tables.view(self.num_seqs, width), keys_t, self.block_size,
                cross=fixed,
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
