"""torch's scaled_dot_product_attention over a packed batch, without padding.

SDPA wants [batch, heads, length, head_size]. Sequences of equal length that sit side by side in the
packed batch already are that shape as a view, so this backend makes one SDPA call per run of equal
lengths: no padding, no masks, no scatter. The input builder packs longest first, so a batch has at
most as many runs as distinct lengths, and the long truncated inputs that dominate the cost share one.
On CPU in bfloat16, long runs use two batched matmuls instead of the flash kernel (faster there).

KV-free cross-attention (decoder queries over their own encoder's keys, packed apart) runs the same way
by runs of one query length: keys are a view when the run's sequences share a key length too, else (one
query each, as monoT5 scores) they are gathered, padded to the run's longest, and masked, in one call.

With a paged KV cache, decoding sequences (one query each) go in one padded call over their blocks read through
their block tables and a mask hiding what lies past each sequence's length: on CPU in float32 (paged_decode.py) keys
gathered a block at a time and values summed straight out of the cache; else whole blocks of both gathered (one
index per block, not per token) for SDPA, or in bfloat16 two matmuls. Prompt chunks run one call each: a whole
prompt attends over its own new keys and never reads the cache; a chunk with context reads its blocks. Paged
cross-attention reads every key from the cache (the step's encoder keys, when given, are written first): the same
calls, never causal. All of it is planned once per step.

Suffix queries (the prefill skip: KV-free, each sequence's last len_q tokens over all its keys) run as
KV-free cross-attention does, with a mask aligned at the end (causal, window, padded keys) where one is
needed: a single last query sees every key of its sequence unless a window hides some.

T5's relative position bias goes in as a float mask, [heads, len_q, len_k] by distance (sdpa_bias.py);
DeBERTa's disentangled bias as a float mask per sequence, made by each layer from its position
projections (sdpa_bias.disentangled_bias), a bounded number of sequences at a time. A
sliding window is a bool mask (sdpa_window.py), made once per step, window and shape; a layer without a
window, or whose window no sequence outgrows, runs as above with no mask.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from embedserv import cpu_isa
from embedserv.attention.backends.base import (
    AttentionLayer,
    PagedBackendBase,
    gather_blocks,
    relative_bias_table,
    step_memo,
    write_kv,
)
from embedserv.attention.backends.naive import future_mask
from embedserv.attention.backends.paged_decode import (
    decode_gathered,
    decode_with_matmuls,
    uses_gathered_decode,
    value_rows,
)
from embedserv.attention.backends.sdpa_bias import (
    chunk_bias,
    decode_bias,
    disentangled_bias,
    disentangled_groups,
    mask_dtype,
    run_bias,
)
from embedserv.attention.backends.sdpa_runs import (
    Chunk,
    CrossRun,
    PagedPlan,
    Run,
    SdpaMetadata,
    plan_cross_runs,
    plan_runs,
)
from embedserv.attention.backends.sdpa_window import (
    attend_banded,
    chunk_window_mask,
    decode_window_mask,
    is_banded,
    run_window_mask,
    suffix_mask,
)
from embedserv.attention.backends.windows import (
    refuse_biased_suffix,
    refuse_biased_window,
    window_within,
)
from embedserv.attention.disentangled import PositionProjections, refuse_disentangled
from embedserv.attention.metadata import CommonAttentionMetadata

# On CPU in bfloat16, where bf16 is native, two batched matmuls beat the flash kernel from a length on
# (cpu_isa.bf16_matmul_attention), as long as the materialized scores stay in cache: runs are
# cut into chunks of at most _SCORES_BYTES of scores. Measured with benchmarks/attention_kernels.py.
_SCORES_BYTES = 2_500_000
# ... with lengths padded to a multiple of this (padded keys masked, padded queries dropped): oneDNN keeps a
# primitive per matmul shape, and every length and chunk size churned its caches and grew the heap without
# bound (models/layers.py says how). Padded, a 256-token model has about 160 shapes.
_MATMUL_LENGTH_STEP = 8


class SdpaBackend(PagedBackendBase):
    name = "sdpa"

    def build_metadata(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        if common.reads_kv_cache:
            return SdpaMetadata(common=common, runs=(), paged=plan_paged(common))
        if common.cross or common.suffix_queries:
            runs = plan_cross_runs(common.seq_lens_q_cpu, common.seq_lens_k_cpu, common.cu_seqlens_q.device)
            return SdpaMetadata(common=common, runs=runs, suffix=common.suffix_queries)
        return SdpaMetadata(common=common, runs=plan_runs(common.seq_lens_q_cpu))

    def forward(
        self, layer: AttentionLayer, q, k, v, kv_cache, meta: SdpaMetadata, positions: PositionProjections | None = None
    ) -> torch.Tensor:
        if kv_cache is not None or meta.common.cross or meta.suffix or meta.is_causal:
            refuse_disentangled(layer, self.name, "paged, cross, suffix or causal attention")
        if kv_cache is not None:
            return forward_paged(layer, q, k, v, kv_cache, meta)
        gqa = q.shape[1] != k.shape[1]
        if meta.common.cross:
            return _concat([_attend_cross(layer, q, k, v, run, gqa) for run in meta.runs])
        if meta.suffix:
            refuse_biased_suffix(layer, self.name)
            return _concat([_attend_suffix(layer, q, k, v, meta, i, gqa) for i in range(len(meta.runs))])
        if positions is not None:
            return _concat(
                [
                    self._attend(
                        layer,
                        q[g.rows],
                        k[g.rows],
                        v[g.rows],
                        g,
                        False,
                        gqa,
                        disentangled_bias(layer, q[g.rows], k[g.rows], positions, meta, g, mask_dtype(q)),
                    )
                    for r in meta.runs
                    for g in disentangled_groups(r, q.shape[1])
                ]
            )
        # T5's and MPNet's bias, a sliding window: only for the layers that have one.
        table = relative_bias_table(layer, meta.memo) if layer.relative_bias is not None else None
        if table is not None:
            refuse_biased_window(layer, self.name)
        windowed = layer.sliding_window is not None
        parts = []
        for r in meta.runs:
            # A bias or a window is the run's whole mask, causal included.
            is_causal, mask, window = meta.is_causal, None, window_within(layer, r.length) if windowed else None
            if table is not None:
                is_causal, mask = False, run_bias(layer, table, meta, r.length, mask_dtype(q))
            elif window is not None and is_banded(window, r.length):
                parts.append(
                    attend_banded(
                        lambda qb, kb, vb, mask: _attend_batched(layer.scale, qb, kb, vb, False, gqa, mask),
                        q[r.rows],
                        k[r.rows],
                        v[r.rows],
                        r.num_seqs,
                        r.length,
                        window,
                        meta,
                        mask_dtype(q),
                    )
                )
                continue
            elif window is not None:
                is_causal, mask = False, run_window_mask(meta, window, r.length)
            parts.append(self._attend(layer, q[r.rows], k[r.rows], v[r.rows], r, is_causal, gqa, mask))
        return _concat(parts)

    @staticmethod
    def _attend(layer: AttentionLayer, q, k, v, run: Run, is_causal: bool, gqa: bool, mask=None) -> torch.Tensor:
        """Rows of one run -> [rows, heads, head_size]; `mask` as _attend_batched takes it."""
        shape = (run.num_seqs, run.length)
        qb = q.view(*shape, *q.shape[1:]).transpose(1, 2)
        kb = k.view(*shape, *k.shape[1:]).transpose(1, 2)
        vb = v.view(*shape, *v.shape[1:]).transpose(1, 2)
        out = _attend_batched(layer.scale, qb, kb, vb, is_causal, gqa, mask)
        return out.transpose(1, 2).reshape(-1, *q.shape[1:])


def _uses_matmuls(q: torch.Tensor, len_q: int) -> bool:
    """q: [num_seqs, heads, len_q, d]."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and cpu_isa.bf16_matmul_attention(q.shape[0], len_q)


def _attend_batched(scale: float, qb, kb, vb, is_causal: bool, gqa: bool, mask=None) -> torch.Tensor:
    """[n, heads, len_q, d] queries over [n, kv_heads, len_k, d] keys -> [n, heads, len_q, d]. `mask`,
    broadcastable to [n, heads, len_q, len_k]: bool (True where a query sees a key) or float of
    _mask_dtype (added to the scores); never together with is_causal."""
    num_seqs, heads, len_q, _ = qb.shape
    if _uses_matmuls(qb, len_q):
        scores_bytes = heads * _padded_length(len_q) * _padded_length(kb.shape[2]) * qb.element_size()
        per_chunk = max(1, _SCORES_BYTES // scores_bytes)
        per_seq = mask is not None and mask.shape[0] > 1
        return _concat(
            [
                _attend_with_matmuls(
                    qb[i : i + per_chunk],
                    kb[i : i + per_chunk],
                    vb[i : i + per_chunk],
                    scale,
                    is_causal,
                    mask[i : i + per_chunk] if per_seq else mask,
                )
                for i in range(0, num_seqs, per_chunk)
            ]
        )
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def _attend_cross(
    layer: AttentionLayer, q, k, v, run: CrossRun, gqa: bool, is_causal: bool = False, mask=None
) -> torch.Tensor:
    """One run of KV-free cross-attention (or suffix queries) -> [run's query rows, heads, head_size].
    `mask` replaces the run's key mask (and must hide its padding); is_causal only for a view."""
    qb = q[run.q_rows].view(run.num_seqs, run.len_q, *q.shape[1:]).transpose(1, 2)
    if run.key_rows is None:
        kb = k[run.k_rows].view(run.num_seqs, run.len_k, *k.shape[1:]).transpose(1, 2)
        vb = v[run.k_rows].view(run.num_seqs, run.len_k, *v.shape[1:]).transpose(1, 2)
    else:
        kb, vb = k[run.key_rows].transpose(1, 2), v[run.key_rows].transpose(1, 2)
    out = _attend_batched(layer.scale, qb, kb, vb, is_causal, gqa, run.key_mask if mask is None else mask)
    return out.transpose(1, 2).reshape(-1, *q.shape[1:])


def _attend_suffix(layer: AttentionLayer, q, k, v, meta: SdpaMetadata, index: int, gqa: bool) -> torch.Tensor:
    """Suffix-query run `index`: each sequence's last len_q queries over all of its keys."""
    run = meta.runs[index]
    window = window_within(layer, run.len_k)
    if window is None and (run.len_q == 1 or not meta.is_causal):
        # Bidirectional, or one query: the last position, which sees every real key.
        return _attend_cross(layer, q, k, v, run, gqa)
    if window is None and run.len_q == run.len_k:
        # Whole sequences (a run of more than one query shares one key length: a view).
        return _attend_cross(layer, q, k, v, run, gqa, is_causal=True)
    return _attend_cross(layer, q, k, v, run, gqa, mask=suffix_mask(meta, index, window))


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy when there is one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _padded_length(length: int) -> int:
    return -(-length // _MATMUL_LENGTH_STEP) * _MATMUL_LENGTH_STEP


def _pad_length(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, L, d] -> [n, heads, _padded_length(L), d], zeros after the real rows."""
    padding = _padded_length(x.shape[2]) - x.shape[2]
    return F.pad(x, (0, 0, 0, padding)) if padding else x


def _attend_with_matmuls(q, k, v, scale: float, is_causal: bool, mask=None) -> torch.Tensor:
    """[n, heads, Lq, d] over [n, kv_heads, Lk, d] as two batched matmuls: the same function, materialized
    scores. `mask` as _attend_batched takes it. Lengths are padded (_MATMUL_LENGTH_STEP): padded keys are
    masked out, and the padded queries' rows are dropped."""
    len_q, len_k = q.shape[2], k.shape[2]
    q, k, v = _pad_length(q), _pad_length(k), _pad_length(v)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None and mask.dtype != torch.bool:
        # A float32 bias: the sum and its softmax in float32 (bfloat16 would round the bias).
        scores = scores.float()
        scores[..., :len_q, :len_k] += mask
    scores[..., len_k:] = float("-inf")
    real = scores[..., :len_q, :len_k]
    if is_causal:
        real.masked_fill_(future_mask(len_q, len_k, q.device), float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        real.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)[:, :, :len_q]


def plan_paged(common: CommonAttentionMetadata) -> PagedPlan:
    """Host-side planning from the host lengths; device tensors are sliced or copied here, once per step."""
    lens_q, lens_k, size = common.seq_lens_q_cpu, common.seq_lens_k_cpu, common.block_size
    starts_q = np.concatenate(([0], np.cumsum(lens_q)[:-1]))
    device = common.block_tables.device
    decodes = np.flatnonzero(lens_q == 1)
    rows = tables = mask = positions = None
    if len(decodes):
        num_blocks = -(-int(lens_k[decodes].max()) // size)
        rows = torch.from_numpy(starts_q[decodes]).to(device)
        tables = common.block_tables[rows.new_tensor(decodes), :num_blocks]
        real = np.arange(num_blocks * size)[None, :] < lens_k[decodes, None]
        mask = torch.from_numpy(real).to(device)[:, None, None, :]
        positions = torch.from_numpy(lens_k[decodes] - 1).to(device)
    chunks = []
    for i in np.flatnonzero(lens_q != 1):
        len_q, len_k = int(lens_q[i]), int(lens_k[i])
        # Cross: every key of the cross table, no mask. Causal: a whole prompt (no context) sees its own
        # keys under the plain causal mask; a chunk with context its keys up to each query's position.
        causal = not common.cross
        chunks.append(
            Chunk(
                rows=slice(int(starts_q[i]), int(starts_q[i]) + len_q),
                len_q=len_q,
                len_k=len_k,
                table=common.block_tables[int(i), : -(-len_k // size)],
                mask=None if not causal or len_q == len_k else ~future_mask(len_q, len_k, device),
                causal=causal,
                own_keys=causal and len_q == len_k,
            )
        )
    return PagedPlan(
        decode_rows=rows,
        decode_tables=tables,
        decode_mask=mask,
        chunks=tuple(chunks),
        decode_positions=positions,
    )


def forward_paged(layer: AttentionLayer, q, k, v, kv_cache, meta: SdpaMetadata, decode_op=None) -> torch.Tensor:
    """`decode_op`: a kernel for the one-token sequences (cpu_varlen's paged_decode), used where no bias is added."""
    write_kv(k, v, kv_cache, meta.common)
    plan = meta.paged
    gqa = q.shape[1] != kv_cache.shape[-2]
    table = relative_bias_table(layer, meta.memo)
    window = window_within(layer, meta.common.max_seqlen_k)
    if table is not None:
        refuse_biased_window(layer, "sdpa")
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        decodes = q[plan.decode_rows]
        if decode_op is not None and table is None:
            out[plan.decode_rows] = decode_op(
                decodes, kv_cache, plan.decode_tables, plan.decode_positions, window or 0, layer.scale
            )
        else:
            out[plan.decode_rows] = _attend_decodes(layer, decodes, kv_cache, meta, table, window, gqa)
    for index, chunk in enumerate(plan.chunks):
        whole = None
        if table is not None:
            whole = chunk_bias(layer, table, meta, index, mask_dtype(q))
        elif window is not None and window < chunk.len_k:
            whole = chunk_window_mask(meta, index, window)
        out[chunk.rows] = _attend_chunk(layer, q[chunk.rows], k, v, kv_cache, chunk, gqa, whole)
    return out


def _attend_chunk(layer: AttentionLayer, q, k, v, kv_cache, chunk: Chunk, gqa: bool, whole=None) -> torch.Tensor:
    """One prompt chunk: [len_q, heads, d]. A whole prompt with its own keys never touches the cache.
    `whole`: the chunk's whole mask, causal included, in place of its own: [1, heads, len_q, len_k]
    float (mask_dtype, T5's bias) or [1, 1, len_q, len_k] bool (a sliding window)."""
    if chunk.own_keys and k is not None:
        run = Run(token_start=0, num_seqs=1, length=chunk.len_q)
        if whole is None:
            return SdpaBackend._attend(layer, q, k[chunk.rows], v[chunk.rows], run, True, gqa)
        return SdpaBackend._attend(layer, q, k[chunk.rows], v[chunk.rows], run, False, gqa, whole)
    keys, values = gather_blocks(kv_cache, chunk.table)
    keys, values = keys[: chunk.len_k], values[: chunk.len_k]
    if whole is not None:
        mask, is_causal = whole, False
    else:
        mask, is_causal = chunk.mask, chunk.causal and chunk.mask is None
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=layer.scale,
        enable_gqa=gqa,
    )
    return attended[0].transpose(0, 1)


def _attend_decodes(layer: AttentionLayer, queries, kv_cache, meta: SdpaMetadata, table, window, gqa: bool):
    """The one-token sequences of a paged step, [n, heads, d], in one call (paged_decode.py says which)."""
    plan = meta.paged
    if table is not None:
        mask = decode_bias(layer, table, meta, mask_dtype(queries))
    else:
        mask = plan.decode_mask if window is None else decode_window_mask(meta, window)
    heads, kv_heads = queries.shape[1], kv_cache.shape[-2]
    if uses_gathered_decode(queries):
        rows = step_memo(
            meta.memo,
            ("decode-value-rows", heads, kv_heads),
            lambda: value_rows(plan.decode_tables, meta.common.block_size, heads, kv_heads),
        )
        return decode_gathered(queries, kv_cache, plan.decode_tables, rows, mask, layer.scale)
    # One coarse gather of whole blocks for every decode: [n, blocks * block_size, kv_heads, d].
    keys, values = gather_blocks(kv_cache, plan.decode_tables)
    if queries.device.type == "cpu" and queries.dtype == torch.bfloat16:
        return decode_with_matmuls(queries, keys, values, mask, layer.scale)
    attended = F.scaled_dot_product_attention(
        queries.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=layer.scale,
        enable_gqa=gqa,
    )
    return attended.squeeze(2)
