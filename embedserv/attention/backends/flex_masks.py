"""The flex backend's KV-free document masks: which packed key rows each packed query row sees, as a
mask_mod and as the BlockMask that lets FlexAttention skip the blocks it rules out.

A query sees the keys of its own sequence; when causal none after its own position, and within a sliding
window only those less than W positions away. Positions are compared as key rows: within one sequence
the distance between two key rows is the distance between their positions. Queries that are their own
keys (a KV-free step) are their own key rows; suffix queries (the prefill skip), packed apart from their
keys, carry their own key row in `q_key`; cross-attention compares sequences only.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from embedserv.attention.backends.windows import in_window

BLOCK_SIZE = 128


def document_mask_mod(
    doc: torch.Tensor,
    is_causal: bool,
    doc_k: torch.Tensor | None = None,
    q_key: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
):
    """mask_mod: True where query row q may attend to key row kv. `doc`, `doc_k`: each query's and key's
    sequence (doc_k None: keys are the query rows); `q_key`: each query's own key row where queries are
    packed apart from their keys (None for cross-attention, or where queries are the keys); `window`: a
    0-d int tensor (an input of the compiled kernel, so a new window value compiles nothing), or None."""
    keys = doc if doc_k is None else doc_k
    cross = doc_k is not None and q_key is None

    def document(b, h, q, kv):
        seen = doc[q] == keys[kv]
        if cross:
            return seen
        position = q if q_key is None else q_key[q]
        if is_causal:
            seen = seen & (kv <= position)
        if window is not None:
            seen = seen & in_window(position, kv, window)
        return seen

    return document


def ordered_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> per query block, how many key blocks are set and their indices first."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def suffix_query_keys(doc: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """[q_size] int64: each query row's own key row, its sequence's queries the last of its keys
    (row r of sequence s is key row r + cu_k[s + 1] - cu_q[s + 1]); padding rows keep their own index."""
    shift = torch.zeros(cu_q.shape[0], dtype=torch.int64, device=doc.device)
    shift[:-1] = cu_k[1:].long() - cu_q[1:].long()
    return torch.arange(doc.shape[0], device=doc.device) + shift[doc.long()]


def document_block_mask(
    doc: torch.Tensor,
    num_seqs: int,
    is_causal: bool,
    doc_k: torch.Tensor | None = None,
    q_key: torch.Tensor | None = None,
    window: int | None = None,
) -> BlockMask:
    """The BlockMask of document_mask_mod, from block-level ranges (no per-token vmap).

    `doc` is non-decreasing, so a block holds the documents first..last: two blocks interact when their
    ranges overlap, and every token pair interacts (a "full" block, no mask_mod call) when both blocks
    lie in one and the same document and positions rule out no pair. Blocks of padding only (document
    `num_seqs`) are left out: their rows are discarded, and attending padding to padding would cost up
    to as much as the real batch.
    """
    keys = doc if doc_k is None else doc_k
    q_blocks, k_blocks = doc.view(-1, BLOCK_SIZE), keys.view(-1, BLOCK_SIZE)
    first, last = q_blocks[:, 0], q_blocks[:, -1]
    first_k, last_k = k_blocks[:, 0], k_blocks[:, -1]
    real = first < num_seqs
    partial = (first[:, None] <= last_k[None, :]) & (first_k[None, :] <= last[:, None]) & real[:, None]
    full = (
        (first == last)[:, None] & (first_k == last_k)[None, :] & (first[:, None] == first_k[None, :]) & real[:, None]
    )
    if is_causal or window is not None:
        some, every = _position_blocks(doc, num_seqs, q_key, keys.shape[0], is_causal, window)
        partial &= some
        full &= every
    partial &= ~full
    window_t = None if window is None else torch.tensor(window, device=doc.device)
    return BlockMask.from_kv_blocks(
        *ordered_blocks(partial),
        *ordered_blocks(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=document_mask_mod(doc, is_causal, doc_k, q_key, window_t),
        seq_lengths=(doc.shape[0], keys.shape[0]),
    )


def _position_blocks(doc, num_seqs: int, q_key, num_keys: int, is_causal: bool, window: int | None):
    """([nq, nk] bool, [nq, nk] bool): the pairs of blocks where positions let some query see some key,
    and where they let every query see every key: a query block's real rows are the key rows lo..hi
    at most, a key block its own rows."""
    rows = torch.arange(doc.shape[0], device=doc.device) if q_key is None else q_key
    real = doc < num_seqs
    lo = torch.where(real, rows, rows.new_tensor(num_keys)).view(-1, BLOCK_SIZE).amin(dim=-1)[:, None]
    hi = torch.where(real, rows, rows.new_tensor(-1)).view(-1, BLOCK_SIZE).amax(dim=-1)[:, None]
    k_lo = torch.arange(0, num_keys, BLOCK_SIZE, device=doc.device)[None, :]
    k_hi = k_lo + BLOCK_SIZE - 1
    some = torch.ones(lo.shape[0], k_lo.shape[1], dtype=torch.bool, device=doc.device)
    every = some.clone()
    if is_causal:
        some &= k_lo <= hi
        every &= k_hi <= lo
    if window is not None:
        some &= (k_lo - hi < window) & (lo - k_hi < window)
        every &= (hi - k_lo < window) & (k_hi - lo < window)
    return some, every


def padded_size(num_tokens: int) -> int:
    """The size class a packed batch of `num_tokens` rows is padded to: a power of two, at least one block."""
    return max(BLOCK_SIZE, 1 << (num_tokens - 1).bit_length())
