"""Runs one scheduled batch: inputs -> attention metadata -> model in the forward context -> head."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput
from embedserv.worker.input_builder import InputBuilder, ModelInputs


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results on the host, one row per scheduled sequence, in scheduler order."""

    request_ids: tuple[int, ...]
    # [num_seqs, dim] float32: pooled embeddings, or logits of a score head.
    rows: np.ndarray


@dataclass(frozen=True)
class PreparedBatch:
    request_ids: tuple[int, ...]
    inputs: ModelInputs


class PrefillModelRunner:
    """Owns the model, its head and its attention backend on one device (embed, rerank, classify).

    The head maps `(hidden [num_tokens, hidden], PoolingInputs)` to one float32 row per sequence: an
    EmbeddingPooler for embedders, a ScoreHead for cross-encoders, classifiers and yes/no rerankers.
    """

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        is_causal: bool,
    ) -> None:
        self.model = model
        self.head = head
        self.backend = backend
        self.device = device
        self.input_builder = InputBuilder(device, model.position_offset, is_causal)

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        return self.run(self.prepare(batch))

    @torch.inference_mode()
    def prepare(self, batch: SchedulerOutput) -> PreparedBatch:
        """The batch's inputs on the device. A worker calls this for batch k+1 while batch k runs."""
        return PreparedBatch(tuple(s.request_id for s in batch.sequences), self.input_builder.build(batch))

    @torch.inference_mode()
    def run(self, prepared: PreparedBatch) -> ModelRunnerOutput:
        inputs = prepared.inputs
        context = ForwardContext(attn_metadata=self.backend.build_metadata(inputs.attention), attn_backend=self.backend)
        with set_forward_context(context):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.token_type_ids)
        rows = self.head(hidden, inputs.pooling)
        # The one device-to-host copy of the step.
        return ModelRunnerOutput(request_ids=prepared.request_ids, rows=rows.cpu().numpy())

    def warm_up(self, max_tokens: int, max_batch_tokens: int) -> None:
        """Runs one batch per power-of-two size up to the token budget, so first requests pay no one-time
        costs (oneDNN primitives per shape; the flex backend compiles a kernel per size class)."""
        for size in warm_up_sizes(max_batch_tokens):
            full, rest = divmod(size, max_tokens)
            lengths = [max_tokens] * full + ([rest] if rest else [])
            batch = SchedulerOutput(
                sequences=tuple(ScheduledSequence(request_id=-1 - i, token_ids=[0] * n) for i, n in enumerate(lengths))
            )
            self.execute(batch)


def warm_up_sizes(max_batch_tokens: int) -> list[int]:
    """8, 128, 256, ... up to and including the budget."""
    sizes = [min(8, max_batch_tokens)]
    size = 128
    while size < max_batch_tokens:
        sizes.append(size)
        size *= 2
    if max_batch_tokens > sizes[-1]:
        sizes.append(max_batch_tokens)
    return sizes
