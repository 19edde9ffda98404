"""--kv-sharing-fast-prefill: which rows the layers after a model's last KV writer run, and their metadata.

Layers that only read an earlier layer's KV change no cache, so a prompt row matters to them only if its
output is read: a sampled row (the last of a chunk that reaches its prompt's end, or a decode), or the last
token a last-token head (lasttoken pooling, yes/no reranker, decoder classifier) reads. A prompt chunk
that samples nothing keeps no row at all on paged steps. Other heads read every row: those sequences keep
all of theirs.

The kept rows are a new packing of the batch (in the batch's packed order): each kept sequence's last
`keep` tokens, whose keys are still all of the sequence's. The metadata says so per KV-cache group:
paged, the kept sequences' rows of the block tables with one query each (a decode's shape) or their whole
chunk; KV-free, queries that are the last `keep` of their sequence's keys (metadata.build_suffix_metadata).
Outputs are then indexed in the kept packing: `out_start` and `out_len` give each sequence's rows there.
The kept rows are padded like the step's (models/layers.py), with row 0 again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embedserv.attention.metadata import (
    AttentionMetadata,
    CommonAttentionMetadata,
    build_paged_metadata,
    build_suffix_metadata,
    cumulative_offsets,
    ranges,
)
from embedserv.models.layers import pad
from embedserv.steps import OutputKind


@dataclass(frozen=True)
class PrefillSkip:
    """--kv-sharing-fast-prefill: the layers after the last one that writes KV (they only read it) run only
    the rows whose output is read: each sampled row, or each last token a last-token head pools. Their
    queries are those rows; their keys stay every token (read from the cache, or the source layers' k and v
    on KV-free steps)."""

    # Attention layer_index of the first layer that runs the kept rows (the model's `prefill_skip_layer`).
    first_layer: int
    # [num_kept] int64 (padded on CPU, models/layers.py): the kept rows, indices into the step's packed
    # tokens, in packed order. The runner hands them to the model (`prefill_skip_rows=`), which keeps
    # them at its `prefill_skip_layer`.
    rows: torch.Tensor
    # Per KV-cache group (as the step's metadata): each kept sequence's kept queries over all of its keys.
    attn_metadata: Sequence[AttentionMetadata]


@dataclass(frozen=True)
class SkipInputs:
    """What the input builder gives the runner for the prefill skip (it makes the PrefillSkip from it)."""

    # [num_kept] int64 (padded on CPU): the kept rows, as PrefillSkip.rows.
    rows: torch.Tensor
    # Per KV-cache group: each kept sequence's kept queries over all of its keys.
    attention: tuple[CommonAttentionMetadata, ...]


class SkipPlan:
    def __init__(
        self,
        seqs,
        order: np.ndarray,
        packed_lens: np.ndarray,
        lens_k: np.ndarray,
        rows_read_last: bool,
        paged: bool,
        padded: Callable[[int], int],
        parts: dict,
    ) -> None:
        """`packed_lens`, `lens_k`: each sequence's queries and keys, in packed order; `padded`: the rows
        run for a number of kept rows. When the skip keeps fewer rows than the step has (`active`), its
        arrays join the step's host `parts` (input_builder.to_device)."""
        keep = np.empty(len(seqs), dtype=np.int64)
        for p, i in enumerate(order):
            seq, length = seqs[i], int(packed_lens[p])
            if not seq.produces_output:
                # Only paged prompt chunks yield nothing; a KV-free sequence always yields its row.
                keep[p] = 0 if paged else length
            elif seq.output is OutputKind.SAMPLE or rows_read_last:
                keep[p] = 1
            else:
                keep[p] = length
        if not keep.any():
            # A step of prompt chunks that sample nothing: one row keeps the layers' shapes non-empty
            # (its output is never read).
            keep[0] = 1
        # Per packed position; and in batch order, each sequence's rows in the kept packing.
        self.keep = keep
        self.active = bool((keep < packed_lens).any())
        if not self.active:
            return
        self.kept = np.flatnonzero(keep > 0)
        self.cu = cumulative_offsets(keep[self.kept])
        ends = cumulative_offsets(packed_lens)[1:][self.kept]
        counts = keep[self.kept]
        self.rows = np.repeat(ends - counts, counts) + ranges(counts)
        self.num_kept_rows = len(self.rows)
        self.out_len = np.empty(len(seqs), dtype=np.int64)
        self.out_len[order] = keep
        starts = np.zeros(len(seqs), dtype=np.int64)
        starts[self.kept] = self.cu[:-1]
        self.out_start = np.empty(len(seqs), dtype=np.int64)
        self.out_start[order] = starts
        self.dropped = np.empty(len(seqs), dtype=np.int64)
        self.dropped[order] = packed_lens - keep
        self.paged = paged
        self.lens_k = lens_k[self.kept]
        parts["skip_rows"] = pad(self.rows, padded(self.num_kept_rows))
        parts["skip_cu_seqlens_q"] = self.cu
        parts["skip_kept"] = self.kept
        if paged:
            # The kept sequences' key offsets, in the step's one host-to-device copy.
            parts["skip_cu_seqlens_k"] = cumulative_offsets(self.lens_k)

    def pos_in_step(self) -> np.ndarray:
        """Each kept row's index among its sequence's kept rows (packed like the kept rows)."""
        return ranges(self.keep[self.kept])

    def inputs(self, device_parts: dict, full: tuple[CommonAttentionMetadata, ...], is_causal: bool) -> SkipInputs:
        """The kept rows and, per group, the metadata of the kept queries over all of their keys; `full`: the
        step's metadata."""
        rows, cu_q, kept = device_parts["skip_rows"], device_parts["skip_cu_seqlens_q"], device_parts["skip_kept"]
        lens_q = self.keep[self.kept]
        if not self.paged:
            (common,) = full
            return SkipInputs(rows, (build_suffix_metadata(lens_q, self.lens_k, cu_q, common.cu_seqlens_k, is_causal),))
        cu_k = device_parts["skip_cu_seqlens_k"]
        # The layers after the last writer write nothing.
        no_slots = torch.empty(0, dtype=torch.int64, device=cu_q.device)
        return SkipInputs(
            rows,
            tuple(
                build_paged_metadata(
                    lens_q,
                    self.lens_k,
                    cu_q,
                    cu_k,
                    no_slots,
                    common.block_tables.index_select(0, kept),
                    common.seq_lens_k.index_select(0, kept),
                    common.block_size,
                )
                for common in full
            ),
        )
