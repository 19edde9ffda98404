"""The paged KV cache's part of a step's inputs (worker/input_builder.py): per KV-cache group, the slot each
new token's keys and values are written to and the block tables [num_seqs, max_blocks], in packed order,
and from them the group's attention metadata.

A fixed (cross-attention) group's new tokens are this step's encoder tokens, and its keys are each
sequence's whole encoder input."""

from __future__ import annotations

import numpy as np
import torch

from embedserv.attention.metadata import CommonAttentionMetadata, build_paged_metadata, cumulative_offsets


class PagedPlan:
    def __init__(self, seqs, order, positions: np.ndarray, block_size: int, fixed_groups, encoder, parts: dict) -> None:
        """`positions`: each packed token's position in its sequence; `fixed_groups`: per KV-cache group, True
        for a fixed one; `encoder`: the step's EncoderPlan (encoder-decoder models). Adds each group's slots
        and tables to the step's host `parts` (input_builder.to_device)."""
        num_groups = len(seqs[0].block_ids)
        self.block_size = block_size
        self.num_seqs = len(seqs)
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
            parts[f"slots_{group}"] = padded[rows, at // block_size] * block_size + at % block_size
            parts[f"block_tables_{group}"] = padded.reshape(-1)
            self.tables_cpu.append(padded)
            self.widths.append(width)

    def metadata(self, device_parts: dict, lens_q, lens_k, cu_q) -> tuple[CommonAttentionMetadata, ...]:
        """Per group, from its device tensors by name; `lens_q`, `lens_k`: the queries and (self-attention) keys
        of each sequence, in packed order."""
        device = cu_q.device
        by_lengths: dict[bool, tuple] = {}
        out = []
        for group, (width, fixed) in enumerate(zip(self.widths, self.fixed, strict=True)):
            slots, tables = device_parts[f"slots_{group}"], device_parts[f"block_tables_{group}"]
            if fixed not in by_lengths:
                keys = self.encoder_lens if fixed else lens_k
                by_lengths[fixed] = (
                    keys,
                    torch.from_numpy(keys).to(device),
                    torch.from_numpy(cumulative_offsets(keys)).to(device),
                )
            keys, keys_t, cu_k = by_lengths[fixed]
            out.append(
                build_paged_metadata(
                    lens_q,
                    keys,
                    cu_q,
                    cu_k,
                    slots,
                    tables.view(self.num_seqs, width),
                    keys_t,
                    self.block_size,
                    cross=fixed,
                )
            )
        return tuple(out)
