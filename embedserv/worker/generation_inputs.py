"""Turns a generation step (GenerationBatch) into flat device tensors with one host-to-device copy.

Each scheduled chunk is a run of a request's tokens starting at `start_position`: a whole prompt, a
piece of one (chunked prefill, or recompute after preemption) or the one token being decoded. Chunks are
packed in scheduler order. Every token gets the cache slot its key and value go to (`slot_mapping`);
every sequence lists the slots of all its keys so far (`key_slots`), which is its block table expanded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from embedserv.attention.metadata import CommonAttentionMetadata, build_paged_metadata, cumulative_offsets
from embedserv.scheduler.generation import GenerationBatch
from embedserv.worker.input_builder import to_device


@dataclass(frozen=True)
class GenerationInputs:
    # [num_tokens] int64
    input_ids: torch.Tensor
    # [num_tokens] int64: each token's position in its request
    positions: torch.Tensor
    attention: CommonAttentionMetadata
    # [num_samples] int64: the rows whose hidden state predicts the next token (a sampling chunk's last)
    sample_rows: torch.Tensor
    # The request of each sampled row, in order; with the known length it is sampled at (see sampler seeds).
    sample_request_ids: tuple[int, ...]
    sample_lengths: tuple[int, ...]


def token_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of token positions [start, end) of a sequence with this block table."""
    positions = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


class GenerationInputBuilder:
    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size

    def build(self, batch: GenerationBatch) -> GenerationInputs:
        chunks = batch.chunks
        lens_q = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))
        lens_k = lens_q + np.fromiter((c.start_position for c in chunks), dtype=np.int64, count=len(chunks))
        cu_q, cu_k = cumulative_offsets(lens_q), cumulative_offsets(lens_k)
        key_slots = [token_slots(c.block_ids, 0, c.start_position + len(c.token_ids), self.block_size) for c in chunks]
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        parts = [
            np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(cu_q[-1])),
            np.concatenate([np.arange(c.start_position, c.start_position + len(c.token_ids)) for c in chunks]),
            cu_q,
            cu_k,
            # A chunk's own keys are the last of its sequence's keys.
            np.concatenate([slots[c.start_position :] for c, slots in zip(chunks, key_slots)]),
            np.concatenate(key_slots),
            cu_q[1:][sampling] - 1,
        ]
        input_ids, positions, cu_q_t, cu_k_t, slot_mapping, key_slots_t, sample_rows = to_device(parts, self.device)
        return GenerationInputs(
            input_ids=input_ids,
            positions=positions,
            attention=build_paged_metadata(lens_q, lens_k, cu_q_t, cu_k_t, slot_mapping, key_slots_t),
            sample_rows=sample_rows,
            sample_request_ids=tuple(chunks[i].request_id for i in sampling),
            sample_lengths=tuple(int(lens_k[i]) for i in sampling),
        )
