"""Runs one scheduled batch: inputs -> attention metadata -> model in the forward context -> head."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput
from embedserv.worker.input_builder import InputBuilder


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results on the host, one row per scheduled sequence, in scheduler order."""

    request_ids: tuple[int, ...]
    # [num_seqs, dim] float32
    pooled: np.ndarray


class EmbeddingModelRunner:
    """Owns the model, its head and its attention backend on one device."""

    def __init__(
        self,
        model: nn.Module,
        pooler: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        is_causal: bool,
    ) -> None:
        self.model = model
        self.pooler = pooler
        self.backend = backend
        self.device = device
        self.input_builder = InputBuilder(device, model.position_offset, is_causal)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        inputs = self.input_builder.build(batch)
        context = ForwardContext(attn_metadata=self.backend.build_metadata(inputs.attention), attn_backend=self.backend)
        with set_forward_context(context):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.token_type_ids)
        pooled = self.pooler(hidden, inputs.pooling)
        # The one device-to-host copy of the step.
        return ModelRunnerOutput(request_ids=tuple(s.request_id for s in batch.sequences), pooled=pooled.cpu().numpy())

    def warm_up(self, max_tokens: int) -> None:
        """Runs a short and a longest-allowed sequence so first requests do not pay one-time costs."""
        batch = SchedulerOutput(
            sequences=(
                ScheduledSequence(request_id=-1, token_ids=[0] * 8),
                ScheduledSequence(request_id=-2, token_ids=[0] * max_tokens),
            )
        )
        self.execute(batch)
