"""Runs one generation step: inputs -> paged attention metadata -> model with the KV cache -> next tokens.

The same model object and attention layers serve the prefill-only path; here the forward context also
carries the per-layer KV caches, which makes every Attention layer write its new keys and values and read
the earlier ones through the block tables.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.engine.types import SamplingParams
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.models.sampler import sample
from embedserv.scheduler.generation import GenerationBatch, ScheduledChunk
from embedserv.worker.generation_inputs import GenerationInputBuilder


class GenerationModelRunner:
    """Owns a causal LM's backbone, LM head, attention backend and KV cache on one device."""

    def __init__(
        self,
        model: nn.Module,
        lm_head: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        kv_caches: list[torch.Tensor],
        block_size: int,
    ) -> None:
        self.model = model
        self.lm_head = lm_head
        self.backend = backend
        self.device = device
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.input_builder = GenerationInputBuilder(device, block_size)

    @torch.inference_mode()
    def execute(self, batch: GenerationBatch, sampling: Mapping[int, SamplingParams]) -> dict[int, int]:
        """Computes the batch's tokens; returns the next token of every request whose chunk samples."""
        inputs = self.input_builder.build(batch)
        context = ForwardContext(
            attn_metadata=self.backend.build_metadata(inputs.attention),
            attn_backend=self.backend,
            kv_caches=self.kv_caches,
        )
        with set_forward_context(context):
            hidden = self.model(inputs.input_ids, inputs.positions)
        if not inputs.sample_request_ids:
            return {}
        logits = self.lm_head(hidden.index_select(0, inputs.sample_rows)).float()
        params = [sampling[request_id] for request_id in inputs.sample_request_ids]
        tokens = sample(logits, params, inputs.sample_lengths)
        # The one device-to-host copy of the step.
        return dict(zip(inputs.sample_request_ids, tokens.tolist()))

    def warm_up(self, prompt_tokens: int) -> None:
        """A prompt and a few decode steps in blocks 0.., before any request owns a block (every slot is
        written before it is read, so what this leaves behind is never seen)."""
        greedy = {-1: SamplingParams(max_tokens=1)}
        num_blocks = -(-(prompt_tokens + 4) // self.block_size)
        blocks = tuple(range(min(num_blocks, self.kv_caches[0].shape[1])))
        length = min(prompt_tokens, len(blocks) * self.block_size - 4)
        if length < 1:
            return
        self.execute(GenerationBatch(chunks=(ScheduledChunk(-1, (0,) * length, 0, blocks, True),)), greedy)
        for step in range(4):
            self.execute(GenerationBatch(chunks=(ScheduledChunk(-1, (0,), length + step, blocks, True),)), greedy)
