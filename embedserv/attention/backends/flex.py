"""FlexAttention over the packed batch with a document mask, compiled.

The whole batch is one sequence to FlexAttention; the mask lets a token see only the tokens of its own
sequence (and, when causal, none after it). The block mask is built from `cu_seqlens` with a few tensor
ops by a step's first layer and shared by the others (flex_masks.py); FlexAttention skips the blocks it
rules out.

The kernel is compiled, on CPU (C++) as on CUDA (Triton): eager FlexAttention materializes the whole
[num_tokens, num_tokens] score matrix, which never pays. Shapes are static: the batch is padded to a
power of two of at least one block, so a model compiles one kernel per size class (warm-up runs them).
Dynamic-shape compilation would avoid the padding, but the CPU template fails to build for some sizes
in torch 2.13.

With a paged KV cache the key sequence is the whole physical cache, read in place (flex_paged.py).

Cross-attention: KV-free, queries and keys are packed apart (each padded to its own size class) and the
document mask compares a query's sequence with a key's; paged, the mask_mod is the same as for
self-attention with each query's limit the last key of its sequence (its encoder length - 1) instead of
its own position. T5's relative position bias is a score_mod that indexes the step's distance table by
the clamped distance between a key's position and the query's; the table and positions are inputs of the
compiled kernel, so a new step compiles nothing. DeBERTa's disentangled bias is a score_mod too: each
layer scores every packed query and key against every relative embedding row ([heads, padded, 2 * span],
inputs of the kernel, fixed by the size class), and the score_mod adds the two scores of the pair's row,
looked up through the step's distance -> row table.

Suffix queries (the prefill skip: KV-free, each sequence's last len_q tokens over all of its keys) are
packed apart from their keys as in cross-attention, and each carries its own key row for the causal
and window tests. A sliding window adds |query - key position| < W to every self-attention mask_mod and
leaves out of the BlockMask the key blocks out of reach; a step keeps one block mask per window (its
full layers use the window-free one), and the window is a captured tensor, so new window values compile
nothing, though windowed layers are compiled entries of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from embedserv.attention.backends.base import (
    AttentionLayer,
    PagedBackendBase,
    relative_bias_table,
    step_memo,
    write_kv,
)
from embedserv.attention.backends.flex_bias import disentangled_mod, packed_positions, relative_bias_mod
from embedserv.attention.backends.flex_masks import (
    document_block_mask,
    padded_size,
    suffix_query_keys,
)
from embedserv.attention.backends.flex_paged import _PagedPlan, paged_block_mask, plan_paged
from embedserv.attention.backends.windows import (
    refuse_biased_suffix,
    refuse_biased_window,
    window_within,
)
from embedserv.attention.disentangled import PositionProjections, refuse_disentangled
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

# On CUDA the Triton kernel tiles the keys BLOCK_N at a time; a tile must lie inside one cache block, and
# Triton's matrix product needs tiles of at least 16 keys. Cache blocks are then a multiple of 16 tokens.
_CUDA_TILE = 16
_CUDA_MAX_TILE = 64


@dataclass(frozen=True)
class FlexMetadata(AttentionMetadata):
    # Tokens the batch (its queries) is padded to: a power of two, at least BLOCK_SIZE.
    padded_tokens: int
    paged: _PagedPlan | None = None
    # KV-free: [padded_tokens] int32, each query row's sequence (padding rows: num_seqs).
    documents: torch.Tensor | None = None
    # KV-free: keys are padded to this many rows (padded_tokens, but where keys are packed apart).
    padded_keys: int = 0
    # KV-free, keys packed apart (cross-attention, suffix queries): [padded_keys] int32, each key row's
    # sequence; None where the queries are the keys.
    documents_k: torch.Tensor | None = None
    # Suffix queries: [padded_tokens] int64, each query row's own key row (flex_masks.suffix_query_keys).
    query_keys: torch.Tensor | None = None
    # What a step's layers share and only the first that needs it makes (the bias table, positions, the
    # KV-free block mask per window: a step's windowed and full layers each use their own).
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def block_mask(self, window: int | None) -> BlockMask:
        """KV-free: the document mask over the packed batch, for layers with this window (or none)."""

        def make() -> BlockMask:
            num_seqs = len(self.common.seq_lens_q_cpu)
            return document_block_mask(
                self.documents, num_seqs, self.common.is_causal, self.documents_k, self.query_keys, window
            )

        return step_memo(self.memo, ("block-mask", window), make)


# Every (dtype, heads, head size, mask kind, score_mod (T5's bias or none), padded size) a process runs
# is one compiled entry of flex_attention; torch gives a function 8 before it silently falls back to eager
# FlexAttention, which materializes the whole score matrix (100-1000x slower). Two models with nine size
# classes each fit in 64. (KV-free cross-attention pads keys to their own size class: monoT5's queries
# stay in the first, BART's match their keys, so it adds about one entry per key size class. A model with
# windowed and full layers doubles its mask kinds; the prefill skip's suffix queries add a kind with
# queries in the smallest size classes.)
_RECOMPILE_LIMIT = 64


@lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo.config as dynamo_config

    # `cache_size_limit` before torch 2.6.
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        # Past the limit, eager FlexAttention over a paged step would score every query against the whole
        # cache (gigabytes, minutes): fail the step loudly instead.
        dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(PagedBackendBase):
    name = "flex"

    def __init__(self, compile: bool = True) -> None:
        # compile=False runs FlexAttention eagerly: same function, full score matrix; tests use it to
        # cover many shapes without compiling each.
        self.compile = compile

    def block_size_multiple_on(self, device: torch.device) -> int:
        return _CUDA_TILE if self.compile and device.type == "cuda" else 1

    def build_metadata(self, common: CommonAttentionMetadata) -> FlexMetadata:
        if common.reads_kv_cache:
            plan = plan_paged(common)
            return FlexMetadata(common=common, padded_tokens=plan.q_pos.shape[0], paged=plan)
        size = padded_size(int(common.seq_lens_q_cpu.sum()))
        doc = _documents(common.cu_seqlens_q, size)
        if not common.cross and not common.suffix_queries:
            return FlexMetadata(common=common, padded_tokens=size, documents=doc, padded_keys=size)
        key_size = padded_size(int(common.seq_lens_k_cpu.sum()))
        query_keys = None
        if not common.cross:
            query_keys = suffix_query_keys(doc, common.cu_seqlens_q, common.cu_seqlens_k)
        return FlexMetadata(
            common=common,
            padded_tokens=size,
            documents=doc,
            padded_keys=key_size,
            documents_k=_documents(common.cu_seqlens_k, key_size),
            query_keys=query_keys,
        )

    def forward(
        self, layer: AttentionLayer, q, k, v, kv_cache, meta: FlexMetadata, positions: PositionProjections | None = None
    ) -> torch.Tensor:
        attend = _compiled_flex() if self.compile else flex_attention
        if kv_cache is not None or meta.common.cross or meta.query_keys is not None or meta.is_causal:
            refuse_disentangled(layer, self.name, "paged, cross, suffix or causal attention")
        if kv_cache is not None:
            return _forward_paged(attend, layer, q, k, v, kv_cache, meta)
        block_mask = meta.block_mask(window_within(layer, meta.common.max_seqlen_k))
        qb, kb = _batch(q, meta.padded_tokens), _batch(k, meta.padded_keys)
        if positions is None:
            score_mod = _packed_bias_mod(layer, meta)
        else:
            score_mod = disentangled_mod(layer, meta, qb, kb, positions)
        out = attend(
            qb,
            kb,
            _batch(v, meta.padded_keys),
            score_mod=score_mod,
            block_mask=block_mask,
            scale=layer.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0, :, : q.shape[0]].transpose(0, 1)


def _packed_bias_mod(layer: AttentionLayer, meta: FlexMetadata):
    """KV-free self-attention's bias score_mod (queries are their own keys), or None without a bias."""
    table = relative_bias_table(layer, meta.memo)
    if table is None:
        return None
    if meta.common.cross:
        raise ValueError("cross-attention takes no relative position bias")
    if meta.query_keys is not None:
        refuse_biased_suffix(layer, "flex")
    refuse_biased_window(layer, "flex")

    pos = packed_positions(meta)
    return relative_bias_mod(table, layer.relative_bias.max_distance, pos, lambda kv: pos[kv])


def _batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """[n, heads, d] -> [1, heads, size, d], padded with zeros."""
    return F.pad(x, (0, 0, 0, 0, 0, size - x.shape[0])).transpose(0, 1).unsqueeze(0)


def _forward_paged(attend, layer: AttentionLayer, q, k, v, kv_cache, meta: FlexMetadata) -> torch.Tensor:
    """Queries over the whole physical cache as one key sequence, through the paged block mask."""
    common, plan = meta.common, meta.paged
    write_kv(k, v, kv_cache, common)
    _, num_blocks, size, kv_heads, head_size = kv_cache.shape
    window = window_within(layer, common.max_seqlen_k)
    block_mask, logical = step_memo(
        plan.masks, (num_blocks, window), lambda: paged_block_mask(plan, common, num_blocks, window)
    )
    score_mod = None
    table = relative_bias_table(layer, meta.memo)
    if table is not None:
        refuse_biased_window(layer, "flex")
        score_mod = relative_bias_mod(
            table, layer.relative_bias.max_distance, plan.q_pos, lambda kv: logical[kv // size] * size + kv % size
        )
    keys = kv_cache[0].view(num_blocks * size, kv_heads, head_size).transpose(0, 1).unsqueeze(0)
    values = kv_cache[1].view(num_blocks * size, kv_heads, head_size).transpose(0, 1).unsqueeze(0)
    # The kernel's default key tile (64 or 128) would span cache blocks; the largest power of two that
    # divides the block size, at most 64, keeps each tile in one block.
    options = {"BLOCK_N": min(size & -size, _CUDA_MAX_TILE)} if q.is_cuda else None
    out = attend(
        _batch(q, meta.padded_tokens),
        keys,
        values,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=layer.scale,
        enable_gqa=q.shape[1] != kv_heads,
        kernel_options=options,
    )
    return out[0, :, : q.shape[0]].transpose(0, 1)


def _documents(cu: torch.Tensor, size: int) -> torch.Tensor:
    """[size] the sequence of each packed row; padding rows past the last offset get num_seqs."""
    rows = torch.arange(size, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)
