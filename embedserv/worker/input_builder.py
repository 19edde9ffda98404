"""Turns a StepBatch into flat device tensors (worker/model_inputs.py) with one host-to-device copy.

Layout: every sequence's tokens of this step one after another, `[num_tokens]`, longest first, with
`cu_seqlens` marking the starts. A sequence's tokens sit at positions start_position.. of it (0.. without
a KV cache). All integers of a step go into one int64 host buffer (pinned on CUDA), cross in one
non-blocking copy, and are sliced apart on the device. Each plan (the tokens; pooled, sampled and per-token
rows; the prefill skip; encoder inputs; images; per KV-cache group the slot of every new token and the block
tables [num_seqs, max_blocks]) adds its host arrays to the step's `parts` under names of its own and reads its
device tensors back by those names, so no plan depends on the order others added theirs.

Models that rotate by M-RoPE (Qwen2-VL's language model: models/mrope.py) get positions [3, padded] instead:
(temporal, height, width) per token, from each sequence's token ids and image grid, each sequence from its
own 0 (padding rows: the offset, like 1-D ones).

On CPU the rows are padded to a bounded set of counts (models/layers.py); padding rows come after the
real ones and belong to no sequence.

Encoder-decoder steps also carry the encoder inputs of the sequences whose encoder runs now, packed in
the decoder's sequence order with their own offsets (the encoder's metadata); cross-attention reads, per
sequence, its encoder's keys: packed ones on KV-free steps, its cross block table on paged ones (where
the new encoder tokens' slots are that group's slot mapping). Such steps order sequences by decoder
length, then encoder length, so that equal shapes sit together.
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from embedserv.attention.metadata import build_common_metadata, cumulative_offsets
from embedserv.models.heads.pooling import PoolingInputs, TokenInputs
from embedserv.models.layers import pad, padded_rows
from embedserv.models.lora import adapter_rows
from embedserv.models.mrope import MRopeSpec, packed_mrope_positions
from embedserv.models.vision_windows import VisionWindows
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
from embedserv.types import EmbedOutput
from embedserv.worker.encoder_inputs import EncoderPlan
from embedserv.worker.image_inputs import ImagePlan
from embedserv.worker.model_inputs import ModelInputs, RowInputs, SampleInputs, StepTokens
from embedserv.worker.paged_inputs import PagedPlan
from embedserv.worker.prefill_skip import SkipPlan


class _OutputRows(NamedTuple):
    """Where each sequence's outputs are (batch order) among the rows the heads read: the packed batch, or
    the rows the prefill skip keeps."""

    start: np.ndarray
    length: np.ndarray
    # Tokens of each sequence left out in front (by the prefill skip).
    dropped: np.ndarray
    # Each row's index among its sequence's rows, row by row.
    pos: np.ndarray


class _Packing(NamedTuple):
    # Batch index of each packed sequence.
    order: np.ndarray
    # In batch order: tokens this step, and the tokens known before it (start positions).
    lens: np.ndarray
    starts: np.ndarray
    # In packed order: queries and keys (context + this step's tokens) of each sequence.
    packed_lens: np.ndarray
    lens_k: np.ndarray
    # Each packed token's position in its sequence.
    positions: np.ndarray
    num_tokens: int
    out: _OutputRows


class InputBuilder:
    def __init__(
        self,
        device: torch.device,
        position_offset: int,
        is_causal: bool,
        block_size: int = 0,
        fixed_groups: tuple[bool, ...] = (),
        is_encoder_decoder: bool = False,
        prefill_skip: bool = False,
        rows_read_last: bool = False,
        pad_rows: bool = False,
        lora: bool = False,
        token_types: bool = False,
        task_adapters: bool = False,
        mrope: MRopeSpec | None = None,
        vision_windows: VisionWindows | None = None,
    ) -> None:
        self.device = device
        self.position_offset = position_offset
        self.is_causal = is_causal
        # 0: the model keeps no KV cache.
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
        # M-RoPE models: 3-D positions from the image token and merge.
        self.mrope = mrope
        # A vision tower with windowed attention: its windows' metadata from the image grids.
        self.vision_windows = vision_windows

    def build(self, batch: StepBatch) -> ModelInputs:
        seqs, paged = batch.sequences, batch.uses_kv_cache
        if paged and not self.block_size:
            raise ValueError("this model keeps no KV cache; it cannot run generation steps")
        parts: dict[str, np.ndarray] = {}
        pack = self._pack(seqs, parts)
        skip = self._skip_plan(seqs, pack, paged, parts) if self.prefill_skip else None
        out = pack.out
        if skip is not None:
            out = _OutputRows(skip.out_start, skip.out_len, skip.dropped, skip.pos_in_step())
        rows = [i for i, s in enumerate(seqs) if s.produces_output and _wants_row(s)]
        pooling = _PoolingPlan(seqs, rows, pack.order, out, parts) if rows else None
        samples = [i for i, s in enumerate(seqs) if s.produces_output and s.output is OutputKind.SAMPLE]
        if samples:
            # Padding rows sample row 0 again (the LM head runs a bounded set of row counts); dropped after.
            parts["sample_rows"] = pad(out.start[samples] + out.length[samples] - 1, self.padded(len(samples)))
        token_plans = {
            kind: _TokenPlan(seqs, members, pack.out, kind.value, parts)
            for kind in (EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR)
            if (members := [i for i, s in enumerate(seqs) if s.output is OutputKind.POOL and kind in s.outputs])
        }
        if token_plans and skip is not None:
            raise ValueError("per-token outputs need every row; they cannot run with the prefill skip")
        encoder = None
        if self.is_encoder_decoder:
            encoder = EncoderPlan(seqs, pack.order, self.position_offset, self.padded, parts)
        images = None
        if any(s.pixels is not None for s in seqs):
            images = ImagePlan(seqs, pack.order, self.padded, parts, self.vision_windows)
        tables = None
        if paged:
            tables = PagedPlan(seqs, pack.order, pack.positions, self.block_size, self.fixed_groups, encoder, parts)
        device = to_device(parts, self.device)
        cu = device["cu_seqlens"]
        if tables is not None:
            attention = tables.metadata(device, pack.packed_lens, pack.lens_k, cu)
        else:
            attention = (build_common_metadata(pack.packed_lens, self.is_causal, cu_seqlens=cu),)
        lora = adapter_rows(np.array([seqs[i].adapter for i in pack.order]), pack.packed_lens) if self.lora else None
        tokens = {kind: plan.inputs(device) for kind, plan in token_plans.items()}
        positions = device["positions"].view(3, -1) if self.mrope is not None else device["positions"]
        return ModelInputs(
            tokens=StepTokens(
                device["input_ids"], positions, device.get("token_type_ids"), device.get("adapter_ids"), lora
            ),
            attention=attention,
            block_tables_cpu=tuple(tables.tables_cpu) if tables is not None else (),
            encoder=encoder.inputs(device, paged, pack.packed_lens, cu) if encoder is not None else None,
            images=images.inputs(device, self.device) if images is not None else None,
            skip=skip.inputs(device, attention, self.is_causal) if skip is not None else None,
            num_output_rows=skip.num_kept_rows if skip is not None else pack.num_tokens,
            rows=pooling.inputs(device) if pooling is not None else None,
            samples=_sample_inputs(seqs, samples, pack, device["sample_rows"]) if samples else None,
            sparse_tokens=tokens.get(EmbedOutput.SPARSE),
            vector_tokens=tokens.get(EmbedOutput.MULTI_VECTOR),
        )

    def _pack(self, seqs: tuple[ScheduledSequence, ...], parts: dict) -> _Packing:
        """Orders and packs the step's tokens, and adds their ids, positions and offsets to `parts` (token types
        and task adapters too where the model reads them)."""
        count = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=count)
        starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=count)
        # Longest first, so equal lengths sit side by side: backends that split by length (sdpa) then work
        # on contiguous runs. Outputs stay in batch order through the pooling and sampling indices.
        if self.is_encoder_decoder:
            order = np.lexsort((-np.fromiter((s.encoder_len for s in seqs), dtype=np.int64, count=count), -lens))
        elif self.lora:
            # --lora: each adapter's sequences side by side (longest first within), one run of rows each.
            order = np.lexsort((-lens, np.fromiter((s.adapter for s in seqs), dtype=np.int64, count=count)))
        else:
            order = np.argsort(-lens, kind="stable")
        packed_lens = lens[order]
        num_tokens = int(packed_lens.sum())
        cu = cumulative_offsets(packed_lens)
        packed_start = np.empty(count, dtype=np.int64)
        packed_start[order] = cu[:-1]
        pos_in_step = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], packed_lens)
        positions = pos_in_step + np.repeat(starts[order], packed_lens)
        padded = self.padded(num_tokens)
        ids = np.fromiter(chain.from_iterable(seqs[i].token_ids for i in order), dtype=np.int64, count=num_tokens)
        parts["input_ids"] = pad(ids, padded)
        if self.mrope is None:
            parts["positions"] = pad(positions, padded) + self.position_offset
        else:
            # Row by row ([3, padded] flattened): the step's integers cross as one flat buffer.
            rows = _mrope_positions([seqs[i] for i in order], self.mrope)
            parts["positions"] = np.concatenate([pad(row, padded) for row in rows]) + self.position_offset
        parts["cu_seqlens"] = cu
        if self.token_types and any(s.token_type_ids is not None for s in seqs):
            parts["token_type_ids"] = pad(_token_types([seqs[i] for i in order], num_tokens), padded)
        if self.task_adapters and any(s.adapter >= 0 for s in seqs):
            # Shifted by one around pad() so that padding rows get -1 (no adapter) rather than adapter 0.
            parts["adapter_ids"] = pad(np.repeat([seqs[i].adapter + 1 for i in order], packed_lens), padded) - 1
        out = _OutputRows(packed_start, lens, np.zeros(count, dtype=np.int64), pos_in_step)
        return _Packing(order, lens, starts, packed_lens, packed_lens + starts[order], positions, num_tokens, out)

    def _skip_plan(self, seqs, pack: _Packing, paged: bool, parts: dict) -> SkipPlan | None:
        """The prefill skip's plan when it keeps fewer rows than the step has (else every row runs every layer)."""
        skip = SkipPlan(seqs, pack.order, pack.packed_lens, pack.lens_k, self.rows_read_last, paged, self.padded, parts)
        return skip if skip.active else None


def _mrope_positions(packed: list[ScheduledSequence], spec: MRopeSpec) -> np.ndarray:
    """[3, num_tokens]: the packed sequences' M-RoPE positions, an image sequence's from its grid."""
    return packed_mrope_positions([(s.token_ids, s.image_grids, s.start_position) for s in packed], spec)


def _unpadded(num_rows: int) -> int:
    return num_rows


def _wants_row(seq: ScheduledSequence) -> bool:
    """SCORE sequences, and POOL ones that want the dense vector."""
    wants_dense = not seq.outputs or EmbedOutput.DENSE in seq.outputs
    return seq.output is OutputKind.SCORE or (seq.output is OutputKind.POOL and wants_dense)


def _sample_inputs(seqs, samples: list[int], pack: _Packing, rows: torch.Tensor) -> SampleInputs:
    return SampleInputs(
        rows=rows,
        request_ids=tuple(seqs[i].request_id for i in samples),
        sampling=tuple(seqs[i].sampling for i in samples),
        lengths=tuple(int(pack.starts[i] + pack.lens[i]) for i in samples),
    )


class _TokenPlan:
    """Every token of the `members` sequences (in batch order) for a per-token output, in `parts` under `name`."""

    def __init__(self, seqs, members: list[int], out: _OutputRows, name: str, parts: dict) -> None:
        lens = out.length[members]
        cu = cumulative_offsets(lens)
        self.request_ids = tuple(seqs[i].request_id for i in members)
        self.lengths = lens
        self.name = name
        total = int(cu[-1])
        parts[f"{name}_rows"] = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - out.start[members], lens)
        parts[f"{name}_seq"] = np.repeat(np.arange(len(members), dtype=np.int64), lens)
        ids = chain.from_iterable(seqs[i].token_ids for i in members)
        parts[f"{name}_input_ids"] = np.fromiter(ids, dtype=np.int64, count=total)

    def inputs(self, device_parts: dict) -> TokenInputs:
        rows, seq, ids = (device_parts[f"{self.name}_{part}"] for part in ("rows", "seq", "input_ids"))
        return TokenInputs(rows, seq, ids, self.request_ids, self.lengths)


class _PoolingPlan:
    """Where each row sequence's pooled tokens are among the rows the head reads (`out`: the packed batch, or
    the rows the prefill skip keeps)."""

    def __init__(self, seqs, rows: list[int], order, out: _OutputRows, parts: dict) -> None:
        self.request_ids = tuple(seqs[i].request_id for i in rows)
        self.adapters = tuple(seqs[i].adapter for i in rows)
        lens = out.length[rows]
        starts = out.start[rows]
        pool_start = np.fromiter(
            (max(0, min(seqs[i].pool_start, len(seqs[i].token_ids) - 1) - out.dropped[i]) for i in rows), np.int64
        )
        parts["pool_first"] = starts + pool_start
        parts["pool_last"] = starts + lens - 1
        parts["pool_counts"] = lens - pool_start
        # Row index of each packed token's sequence (-1: a sequence without a row).
        row_of_seq = np.full(len(seqs), -1, dtype=np.int64)
        row_of_seq[rows] = np.arange(len(rows))
        token_row = np.repeat(row_of_seq[order], out.length[order])
        pool_from = np.zeros(len(seqs), dtype=np.int64)
        pool_from[rows] = pool_start
        counted = (token_row >= 0) & (out.pos >= np.repeat(pool_from[order], out.length[order]))
        # None when every token counts (then the rows are all of them, in order).
        if bool(counted.all()):
            parts["pool_token_seq"] = token_row
        else:
            parts["pool_token_index"] = np.flatnonzero(counted)
            parts["pool_token_seq"] = token_row[counted]

    def inputs(self, device_parts: dict) -> RowInputs:
        pooling = PoolingInputs(
            first_index=device_parts["pool_first"],
            last_index=device_parts["pool_last"],
            token_index=device_parts.get("pool_token_index"),
            token_seq=device_parts["pool_token_seq"],
            token_count=device_parts["pool_counts"].float(),
        )
        return RowInputs(pooling, self.request_ids, self.adapters)


def _token_types(seqs: list[ScheduledSequence], num_tokens: int) -> np.ndarray:
    for s in seqs:
        # fromiter below would silently shift every later sequence's types.
        if s.token_type_ids is not None and len(s.token_type_ids) != len(s.token_ids):
            raise ValueError(f"{len(s.token_type_ids)} token type ids for {len(s.token_ids)} tokens")
    types = chain.from_iterable(
        s.token_type_ids if s.token_type_ids is not None else [0] * len(s.token_ids) for s in seqs
    )
    return np.fromiter(types, dtype=np.int64, count=num_tokens)


def to_device(parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Named int64 host arrays -> device tensors by the same names, through one (pinned, non-blocking) copy."""
    arrays = list(parts.values())
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    if device.type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    return dict(zip(parts, host.split([len(a) for a in arrays]), strict=True))
