"""Runs one StepBatch: inputs -> attention metadata per group -> model in the forward context -> heads.

One runner per replica, whatever the step holds: POOL / SCORE sequences end in the row head (an
EmbeddingPooler for embedders, a ScoreHead for cross-encoders, classifiers and yes/no rerankers), SAMPLE
sequences in the LM head and the sampler, over the paged KV cache. POOL sequences that ask for a sparse or
a per-token output also go through the sparse head (hidden -> sorted (sequence, vocabulary id, value)
triplets of the non-zero entries) or the token head (hidden rows -> one vector per token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from itertools import product

import numpy as np
import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.layer import attention_layers
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.models.heads.adapter_heads import AdapterScoreHeads
from embedserv.models.heads.pooling import TokenInputs
from embedserv.models.heads.sampler import sample
from embedserv.models.interface import Model, ModelKind
from embedserv.models.layers import padded_rows, row_counts, warm_linear_row_counts
from embedserv.models.lora import has_lora
from embedserv.scheduler.kv_cache_manager import KvCacheLayout
from embedserv.steps import OutputKind, RaggedRows, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import EmbedOutput, SamplingParams
from embedserv.worker.input_builder import InputBuilder
from embedserv.worker.kv_cache import KvCache
from embedserv.worker.layer_routes import LayerRoutes
from embedserv.worker.model_inputs import ModelInputs
from embedserv.worker.prefill_skip import PrefillSkip

logger = logging.getLogger(__name__)

# Prompt length of the generation warm-up (one prefill, then a few decode steps).
_GENERATION_WARM_UP_TOKENS = 64
_NO_ROWS = np.zeros((0, 0), dtype=np.float32)
_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PreparedStep:
    inputs: ModelInputs
    # Blocks per KV group this step uses for the first time: zeroed before it runs (see KvCache).
    fresh_blocks: list[list[int]] | None
    # Dual encoders (CLIP, SigLIP) run a step's texts and images as two passes, one per tower: the images'.
    images: PreparedStep | None = None


class ModelRunner:
    """Owns the model, its heads, its attention backend and (generating models) its KV cache on one device."""

    def __init__(
        self,
        model: Model,
        backend: AttentionBackend,
        device: torch.device,
        is_causal: bool,
        row_head: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        kv_cache: KvCache | None = None,
        kv_sharing_fast_prefill: bool = False,
        rows_read_last: bool = False,
        sparse_head: nn.Module | None = None,
        token_head: nn.Module | None = None,
        pad_rows: bool = True,
    ) -> None:
        """`pad_rows`: on CPU, run padded row counts (models/layers.py); tests that count rows turn it off."""
        self.model = model
        self.backend = backend
        self.device = device
        self.row_head = row_head
        # --lora adapters with classifier heads of their own: the row head picks one per row.
        self.heads_by_adapter = isinstance(row_head, AdapterScoreHeads)
        self.sparse_head = sparse_head
        # None: a sequence's token vectors are its last hidden states (float32).
        self.token_head = token_head
        self.lm_head = lm_head
        self.kv_cache = kv_cache
        block_size = kv_cache.block_size if kv_cache is not None else 0
        fixed = tuple(group.fixed for group in kv_cache.groups) if kv_cache is not None else ()
        # The call the model's kind declares (models/interface.py).
        self._forward = _FORWARDS[model.kind]
        self.is_encoder_decoder = model.kind is ModelKind.ENCODER_DECODER
        # --kv-sharing-fast-prefill: the first layer that runs only the rows whose output is read.
        self.skip_layer = model.prefill_skip_layer if kv_sharing_fast_prefill else None
        if kv_sharing_fast_prefill and self.skip_layer is None:
            raise ValueError("--kv-sharing-fast-prefill needs a model whose last layers share an earlier layer's KV")
        self.routes = LayerRoutes(attention_layers(model))
        # Dual encoders run one tower per pass and pool through the model's own heads: model.pool(hidden,
        # pooling, images), each tower its own (CLIP's class token or last token and projection, SigLIP's
        # attention head).
        self.is_dual_encoder = model.kind is ModelKind.DUAL_ENCODER
        # --lora adapters: their layers find the step's rows per adapter in the forward context.
        self.has_lora = has_lora(model)
        # Resolved once: a KvCache keeps its tensors for its lifetime.
        self.layer_kv_caches = self.routes.kv_caches(kv_cache.tensors) if kv_cache is not None else None
        self.input_builder = InputBuilder(
            device,
            model.position_offset,
            is_causal,
            block_size,
            fixed,
            self.is_encoder_decoder,
            prefill_skip=self.skip_layer is not None,
            rows_read_last=rows_read_last,
            pad_rows=pad_rows and device.type == "cpu",
            lora=self.has_lora,
            token_types=model.kind is ModelKind.ENCODER and model.reads_token_types,
            task_adapters=model.kind is ModelKind.ENCODER and model.has_task_adapters,
            mrope=model.mrope,
            vision_windows=model.vision_windows,
        )

    def kv_cache_layout(self) -> KvCacheLayout | None:
        """What the engine's scheduler manages of this runner's KV cache; None without one."""
        if self.kv_cache is None:
            return None
        groups = tuple(group.scheduler_group() for group in self.kv_cache.groups)
        return KvCacheLayout(num_blocks=self.kv_cache.num_blocks, groups=groups)

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.run(self.prepare(batch))

    @torch.inference_mode()
    def prepare(self, batch: StepBatch) -> PreparedStep:
        """The step's inputs on the device. A worker calls this for step k+1 while step k runs."""
        if self.is_dual_encoder:
            images = tuple(s for s in batch.sequences if s.pixels is not None)
            if images and len(images) < batch.num_sequences:
                texts = StepBatch(tuple(s for s in batch.sequences if s.pixels is None))
                return replace(self.prepare(texts), images=self.prepare(StepBatch(images)))
        inputs = self.input_builder.build(batch)
        fresh = self.kv_cache.fresh_blocks(inputs.block_tables_cpu) if inputs.block_tables_cpu else None
        return PreparedStep(inputs, fresh)

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> StepOutput:
        """One pass over the prepared step; a dual encoder's images, prepared apart, run as a second pass."""
        inputs = prepared.inputs
        if prepared.fresh_blocks is not None:
            self.kv_cache.zero(prepared.fresh_blocks)
        with set_forward_context(self._context(inputs)):
            hidden = self._forward(self.model, inputs)
        if inputs.num_output_rows is not None:
            hidden = hidden[: inputs.num_output_rows]  # the padding rows (models/layers.py)
        rows, tokens, sparse, vectors = _NO_ROWS, _NO_TOKENS, None, None
        # One device-to-host copy per kind of output.
        if inputs.rows is not None:
            if self.is_dual_encoder:
                pooled = self.model.pool(hidden, inputs.rows.pooling, inputs.images is not None).float()
            else:
                # --lora adapters with heads of their own (modules_to_save) pick each row's head.
                extra = (inputs.rows.adapters,) if self.heads_by_adapter else ()
                pooled = self.row_head(hidden, inputs.rows.pooling, *extra)
            rows = pooled.cpu().numpy()
        if inputs.samples is not None:
            samples = inputs.samples
            logits = self.lm_head(hidden.index_select(0, samples.rows))[: len(samples.sampling)].float()
            tokens = sample(logits, samples.sampling, samples.lengths).cpu().numpy()
        if inputs.sparse_tokens is not None:
            sparse = self._sparse(hidden, inputs.sparse_tokens)
        if inputs.vector_tokens is not None:
            vectors = self._vectors(hidden, inputs.vector_tokens)
        output = StepOutput(
            inputs.rows.request_ids if inputs.rows is not None else (),
            rows,
            inputs.samples.request_ids if inputs.samples is not None else (),
            tokens,
            sparse,
            vectors,
        )
        return output if prepared.images is None else _joined(output, self.run(prepared.images))

    def _context(self, inputs: ModelInputs) -> ForwardContext:
        """Each attention layer's metadata and cache in this step (worker/layer_routes.py)."""
        build = self.backend.build_metadata
        skip = encoder = cross = windows = None
        if inputs.skip is not None:
            kept = tuple(build(common) for common in inputs.skip.attention)
            skip = PrefillSkip(first_layer=self.skip_layer, rows=inputs.skip.rows, attn_metadata=kept)
        if inputs.encoder is not None:
            encoder = build(inputs.encoder.attention)
            cross = build(inputs.encoder.cross_attention) if inputs.encoder.cross_attention is not None else None
        elif inputs.images is not None:
            # The vision tower's layers are encoder layers over the image rows (worker/image_inputs.py).
            encoder = build(inputs.images.attention)
            windows = build(inputs.images.windows) if inputs.images.windows is not None else None
        context = self.routes.context(
            self.backend,
            tuple(build(common) for common in inputs.attention),
            layer_kv_caches=self.layer_kv_caches if inputs.attention[0].reads_kv_cache else None,
            encoder_metadata=encoder,
            cross_metadata=cross,
            skip=skip,
            window_metadata=windows,
        )
        lora = inputs.tokens.adapter_rows
        return context if lora is None else replace(context, lora=lora)

    def _sparse(self, hidden: torch.Tensor, tokens: TokenInputs) -> RaggedRows:
        if self.sparse_head is None:
            raise ValueError("this model has no sparse output")
        seq, index, value = self.sparse_head(hidden, tokens)
        counts = torch.bincount(seq, minlength=tokens.num_seqs)
        return RaggedRows(
            tokens.request_ids,
            counts.cpu().numpy().astype(np.int64),
            value.float().cpu().numpy(),
            index.cpu().numpy().astype(np.int64),
        )

    def _vectors(self, hidden: torch.Tensor, tokens: TokenInputs) -> RaggedRows:
        rows = hidden.index_select(0, tokens.rows)
        vectors = rows if self.token_head is None else self.token_head(rows)
        return RaggedRows(
            tokens.request_ids, np.asarray(tokens.lengths, dtype=np.int64), vectors.float().cpu().numpy(), _NO_IDS
        )

    def warm_up(self, max_tokens: int, max_batch_tokens: int) -> None:
        """Runs the shapes first requests would otherwise pay one-time costs for (oneDNN primitives per
        shape; the flex backend compiles a kernel per size class). With padded rows (CPU), then every
        linear of the model once at every row count a step can have (layers.warm_linear_row_counts)."""
        if self.input_builder.padded is not padded_rows:
            self._warm_up_steps(max_tokens, max_batch_tokens)
            return
        counts = row_counts(max_batch_tokens)
        made = warm_linear_row_counts(
            self.model, lambda: self._warm_up_steps(max_tokens, max_batch_tokens), counts, unfused=self.has_lora
        )
        logger.info("warmed up %d linear calls over %d row counts", made, len(counts))

    def _warm_up_steps(self, max_tokens: int, max_batch_tokens: int) -> None:
        # A model without a row head warms up its sparse or token output; dual encoders pool through their own.
        pools = self.row_head is not None or self.is_dual_encoder
        outputs = (
            ()
            if pools
            else (EmbedOutput.SPARSE,)
            if self.sparse_head is not None
            else ((EmbedOutput.MULTI_VECTOR,) if self.token_head is not None else None)
        )
        if outputs is not None:
            kind = OutputKind.POOL
            # --lora: the sizes again with an adapter, whose linears run more shapes (unfused activations).
            for size, adapter in product(warm_up_sizes(max_batch_tokens), (-1, 0) if self.has_lora else (-1,)):
                full, rest = divmod(size, max_tokens)
                lengths = [max_tokens] * full + ([rest] if rest else [])
                self.execute(
                    StepBatch(
                        tuple(
                            replace(self._warm_up_sequence(-1 - i, n, kind), outputs=outputs, adapter=adapter)
                            for i, n in enumerate(lengths)
                        )
                    )
                )
        if self.lm_head is not None and self.kv_cache is not None:
            self._warm_up_generation(_GENERATION_WARM_UP_TOKENS)
        if self.is_dual_encoder:
            self._warm_up_images(max_batch_tokens)

    def _warm_up_images(self, max_batch_tokens: int) -> None:
        """The vision tower's step shapes: as many images (of the model's fixed row count) as each size holds."""
        rows, patch_dim, grid = self.model.image_shape
        blank = np.zeros((rows, patch_dim), dtype=np.float32)
        for size in warm_up_sizes(max_batch_tokens):
            self.execute(
                StepBatch(
                    tuple(
                        ScheduledSequence(
                            request_id=-1 - i,
                            token_ids=(0,) * rows,
                            output=OutputKind.POOL,
                            pixels=blank,
                            image_grids=(grid,),
                        )
                        for i in range(max(1, size // rows))
                    )
                )
            )

    def _warm_up_sequence(self, request_id: int, length: int, kind: OutputKind) -> ScheduledSequence:
        if not self.is_encoder_decoder:
            return ScheduledSequence(request_id=request_id, token_ids=(0,) * length, output=kind)
        # The encoder takes the length; the decoder one token (a yes/no reranker's first step).
        return ScheduledSequence(
            request_id=request_id, token_ids=(0,), output=kind, encoder_token_ids=(0,) * length, encoder_len=length
        )

    def _warm_up_generation(self, prompt_tokens: int) -> None:
        """A prompt and a few decode steps in blocks 0.., before any request owns a block (every slot is
        written before it is read, so what this leaves behind is never seen)."""
        greedy = SamplingParams(max_tokens=1)
        block_size = self.kv_cache.block_size
        blocks = tuple(range(min(-(-(prompt_tokens + 4) // block_size), self.kv_cache.num_blocks)))
        length = min(prompt_tokens, len(blocks) * block_size - 4)
        if length < 1:
            return
        tables = (blocks,) * len(self.kv_cache.groups)
        # An encoder-decoder model's encoder takes the same length (the cross blocks are the same ids).
        encoder = (0,) * length if self.is_encoder_decoder else ()
        step = ScheduledSequence(
            -1,
            (0,) * length,
            OutputKind.SAMPLE,
            0,
            tables,
            True,
            greedy,
            encoder_token_ids=encoder,
            encoder_len=len(encoder),
        )
        self.execute(StepBatch((step,)))
        for offset in range(4):
            self.execute(
                StepBatch(
                    (
                        ScheduledSequence(
                            -1, (0,), OutputKind.SAMPLE, length + offset, tables, True, greedy, encoder_len=len(encoder)
                        ),
                    )
                )
            )


def _joined(first: StepOutput, second: StepOutput) -> StepOutput:
    """Two passes' outputs as one step's (rows only: dual encoders give dense vectors)."""
    rows = (
        np.concatenate((first.rows, second.rows))
        if len(first.rows) and len(second.rows)
        else (first.rows if len(first.rows) else second.rows)
    )
    return StepOutput(first.row_request_ids + second.row_request_ids, rows, (), _NO_TOKENS)


def _forward_encoder(model: Model, inputs: ModelInputs) -> torch.Tensor:
    """Token types to an encoder that reads them; each token's task adapter to one that has built-in adapters
    (--lora adapters go through the forward context instead); a vision-language encoder's images (ColModernVBERT)
    as a decoder's."""
    tokens = inputs.tokens
    if model.takes_images and inputs.images is not None:
        return model(tokens.input_ids, tokens.positions, inputs.images.pixel_values, inputs.images.grids)
    if model.has_task_adapters:
        return model(tokens.input_ids, tokens.positions, tokens.token_type_ids, adapter_ids=tokens.adapter_ids)
    if model.reads_token_types:
        return model(tokens.input_ids, tokens.positions, tokens.token_type_ids)
    return model(tokens.input_ids, tokens.positions)


def _forward_decoder(model: Model, inputs: ModelInputs) -> torch.Tensor:
    """A vision-language model's images (patch rows and grids, packed order); the prefill skip's kept rows."""
    tokens, images = inputs.tokens, inputs.images
    if model.takes_images:
        extra = () if images is None else (images.pixel_values, images.grids)
        return model(tokens.input_ids, tokens.positions, *extra)
    if inputs.skip is not None:
        return model(tokens.input_ids, tokens.positions, prefill_skip_rows=inputs.skip.rows)
    return model(tokens.input_ids, tokens.positions)


def _forward_encoder_decoder(model: Model, inputs: ModelInputs) -> torch.Tensor:
    """The encoder over the encoder inputs that run now (none on later generation steps), then the decoder."""
    tokens, encoder = inputs.tokens, inputs.encoder
    if encoder is None:
        return model(tokens.input_ids, tokens.positions)
    return model(tokens.input_ids, tokens.positions, encoder.input_ids, encoder.positions)


def _forward_dual_encoder(model: Model, inputs: ModelInputs) -> torch.Tensor:
    """The text tower, or on the image pass the vision tower over the patch rows."""
    tokens, images = inputs.tokens, inputs.images
    if images is None:
        return model(tokens.input_ids, tokens.positions)
    return model(tokens.input_ids, tokens.positions, images.pixel_values, images.grids)


_FORWARDS = {
    ModelKind.ENCODER: _forward_encoder,
    ModelKind.DECODER: _forward_decoder,
    ModelKind.ENCODER_DECODER: _forward_encoder_decoder,
    ModelKind.DUAL_ENCODER: _forward_dual_encoder,
}


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
