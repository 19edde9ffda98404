"""FlexAttention over the packed batch with a document mask, compiled.

The whole batch is one sequence to FlexAttention; the mask lets a token see only the tokens of its own
sequence (and, when causal, none after it). The block mask is built once per batch from `cu_seqlens` with
a few tensor ops and shared by every layer; FlexAttention skips the blocks it rules out.

The kernel is compiled, on CPU (C++) as on CUDA (Triton): eager FlexAttention materializes the whole
[num_tokens, num_tokens] score matrix, which never pays. Shapes are static: the batch is padded to a
power of two of at least one block, so a model compiles one kernel per size class (warm-up runs them).
Dynamic-shape compilation would avoid the padding, but the CPU template fails to build for some sizes
in torch 2.13.

With a KV cache (generation) the keys are read from the cache through the block tables into their own
packed batch, and the mask pairs each query with its sequence's keys up to its own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from embedserv.attention.backends.base import write_and_gather
from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

BLOCK_SIZE = 128


@dataclass(frozen=True)
class FlexMetadata(AttentionMetadata):
    block_mask: BlockMask
    # Tokens the batch is padded to: a power of two, at least BLOCK_SIZE.
    padded_tokens: int
    # Keys the batch is padded to; equal to padded_tokens on KV-free paths.
    padded_keys: int


# Every (dtype, heads, head size, mask kind, padded size) a process runs is one compiled entry of
# flex_attention; torch gives a function 8 before it silently falls back to eager FlexAttention, which
# materializes the whole score matrix (100-1000x slower). Two models with nine size classes each fit in 64.
_RECOMPILE_LIMIT = 64


@lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo.config as dynamo_config

    # `cache_size_limit` before torch 2.6.
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


def padded_size(num_tokens: int) -> int:
    return max(BLOCK_SIZE, 1 << (num_tokens - 1).bit_length())


def document_mask_mod(doc: torch.Tensor, is_causal: bool):
    """mask_mod: True where query token q may attend to key token kv (same sequence, not later if causal)."""
    if is_causal:
        def causal_document(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        return causal_document

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    return document


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> per query block, how many key blocks are set and their indices first."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def document_block_mask(doc: torch.Tensor, num_seqs: int, is_causal: bool) -> BlockMask:
    """The BlockMask of the document mask, from block-level document ranges (no per-token vmap).

    `doc` is non-decreasing, so a block holds the documents first..last: two blocks interact when their
    ranges overlap, and every token pair interacts (a "full" block, no mask_mod call) when both blocks
    lie in one and the same document. Blocks of padding only (document `num_seqs`) are left out: their
    rows are discarded, and attending padding to padding would cost up to as much as the real batch.
    """
    size = doc.shape[0]
    blocks = doc.view(-1, BLOCK_SIZE)
    first, last = blocks[:, 0], blocks[:, -1]
    real = first < num_seqs
    partial = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None]) & real[:, None]
    full = (first == last)[:, None] & (first == last)[None, :] & (first[:, None] == first[None, :]) & real[:, None]
    if is_causal:
        below = torch.ones_like(partial).tril_()
        partial &= below
        full &= below.tril_(-1)
    partial &= ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full),
        BLOCK_SIZE=BLOCK_SIZE, mask_mod=document_mask_mod(doc, is_causal), seq_lengths=(size, size),
    )


class FlexBackend:
    name = "flex"

    def __init__(self, compile: bool = True) -> None:
        # compile=False runs FlexAttention eagerly: same function, full score matrix; tests use it to
        # cover many shapes without compiling each.
        self.compile = compile

    def build_metadata(self, common: CommonAttentionMetadata) -> FlexMetadata:
        if common.reads_kv_cache:
            return paged_metadata(common)
        size = padded_size(int(common.seq_lens_q_cpu.sum()))
        doc = _documents(common.cu_seqlens_q, size)
        block_mask = document_block_mask(doc, len(common.seq_lens_q_cpu), common.is_causal)
        return FlexMetadata(common=common, block_mask=block_mask, padded_tokens=size, padded_keys=size)

    def forward(self, layer, q, k, v, kv_cache, meta: FlexMetadata) -> torch.Tensor:
        if kv_cache is not None:
            k, v = write_and_gather(k, v, kv_cache, meta.common)
        attend = _compiled_flex() if self.compile else flex_attention
        num_tokens = q.shape[0]

        def batch(x, size):  # [n, heads, d] -> [1, heads, size, d]
            return F.pad(x, (0, 0, 0, 0, 0, size - x.shape[0])).transpose(0, 1).unsqueeze(0)

        out = attend(
            batch(q, meta.padded_tokens), batch(k, meta.padded_keys), batch(v, meta.padded_keys),
            block_mask=meta.block_mask, scale=layer.scale, enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0, :, :num_tokens].transpose(0, 1)


def _documents(cu: torch.Tensor, size: int) -> torch.Tensor:
    """[size] the sequence of each packed row; padding rows past the last offset get num_seqs."""
    rows = torch.arange(size, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), rows, right=True)


def paged_metadata(common: CommonAttentionMetadata) -> FlexMetadata:
    """Queries over keys read from the cache: query i of a sequence with Lq queries and Lk keys sits at key
    position Lk - Lq + i and sees that sequence's keys up to it."""
    num_seqs = len(common.seq_lens_q_cpu)
    q_size = padded_size(int(common.seq_lens_q_cpu.sum()))
    k_size = padded_size(int(common.seq_lens_k_cpu.sum()))
    cu_q, cu_k = common.cu_seqlens_q.long(), common.cu_seqlens_k.long()
    q_doc, k_doc = _documents(cu_q, q_size), _documents(cu_k, k_size)
    # Padding keys belong to no sequence; padding queries see nothing (their rows are discarded).
    k_doc = torch.where(k_doc < num_seqs, k_doc, -1)
    q_seq, k_seq = q_doc.clamp(max=num_seqs - 1), k_doc.clamp(min=0)
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    q_position = torch.arange(q_size, device=cu_q.device) - cu_q[q_seq] + (lens_k - lens_q)[q_seq]
    k_position = torch.arange(k_size, device=cu_k.device) - cu_k[k_seq]

    def paged_causal(b, h, q, kv):
        return (q_doc[q] == k_doc[kv]) & (k_position[kv] <= q_position[q])

    block_mask = create_block_mask(paged_causal, None, None, q_size, k_size, device=cu_q.device, BLOCK_SIZE=BLOCK_SIZE)
    return FlexMetadata(common=common, block_mask=block_mask, padded_tokens=q_size, padded_keys=k_size)
