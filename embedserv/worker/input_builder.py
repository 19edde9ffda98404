"""Turns a SchedulerOutput into flat device tensors with one host-to-device copy.

Layout: every sequence's tokens one after another (longest first), `[num_tokens]`, with `cu_seqlens`
marking the starts.
All integers of a batch go into one int64 host buffer (pinned on CUDA), cross in one non-blocking copy,
and are sliced apart on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from embedserv.attention.metadata import CommonAttentionMetadata, build_common_metadata, cumulative_offsets
from embedserv.models.heads import PoolingInputs
from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput


@dataclass(frozen=True)
class ModelInputs:
    # [num_tokens] int64
    input_ids: torch.Tensor
    # [num_tokens] int64, already shifted by the model's position offset
    positions: torch.Tensor
    # [num_tokens] int64, or None when every token is type 0
    token_type_ids: torch.Tensor | None
    attention: CommonAttentionMetadata
    pooling: PoolingInputs


class InputBuilder:
    def __init__(self, device: torch.device, position_offset: int, is_causal: bool) -> None:
        self.device = device
        self.position_offset = position_offset
        self.is_causal = is_causal

    def build(self, batch: SchedulerOutput) -> ModelInputs:
        seqs = batch.sequences
        seq_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        num_tokens = int(seq_lens.sum())
        # Longest first, so equal lengths sit side by side: backends that pad or split by length
        # (sdpa) then work on contiguous runs. Outputs stay in scheduler order through the pool indices.
        order = np.argsort(-seq_lens, kind="stable")
        packed_lens = seq_lens[order]
        cu = cumulative_offsets(packed_lens)
        packed_start = np.empty(len(seqs), dtype=np.int64)
        packed_start[order] = cu[:-1]
        pool_start = np.fromiter((min(s.pool_start, len(s.token_ids) - 1) for s in seqs), dtype=np.int64)
        has_types = any(s.token_type_ids is not None for s in seqs)
        skips_prompt = bool(pool_start.any())

        seq_of_token = np.repeat(order, packed_lens)
        pos_in_seq = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1], packed_lens)
        parts = [
            np.fromiter(chain.from_iterable(seqs[i].token_ids for i in order), dtype=np.int64, count=num_tokens),
            pos_in_seq + self.position_offset,
            cu,
            packed_start + pool_start,
            packed_start + seq_lens - 1,
            seq_lens - pool_start,
        ]
        if skips_prompt:
            counted = pos_in_seq >= pool_start[seq_of_token]
            parts += [np.flatnonzero(counted), seq_of_token[counted]]
        else:
            parts.append(seq_of_token)
        if has_types:
            parts.append(self._token_types([seqs[i] for i in order], num_tokens))
        device_parts = to_device(parts, self.device)

        input_ids, positions, cu_t, first, last, counts = device_parts[:6]
        rest = device_parts[6:]
        token_index = rest.pop(0) if skips_prompt else None
        token_seq = rest.pop(0)
        token_type_ids = rest.pop(0) if has_types else None
        return ModelInputs(
            input_ids=input_ids,
            positions=positions,
            token_type_ids=token_type_ids,
            attention=build_common_metadata(packed_lens, self.is_causal, cu_seqlens=cu_t),
            pooling=PoolingInputs(
                first_index=first,
                last_index=last,
                token_index=token_index,
                token_seq=token_seq,
                token_count=counts.float(),
            ),
        )

    @staticmethod
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
