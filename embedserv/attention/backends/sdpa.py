"""torch's scaled_dot_product_attention over a packed batch.

SDPA wants [batch, heads, length, head_size], so this backend pads, and only here. To keep padding cheap
it sorts the sequences by length into a few buckets of similar lengths (one SDPA call each) and lays all
buckets out in one padded buffer: each layer scatters q/k/v into it once and gathers the output once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from embedserv.attention.metadata import AttentionMetadata, CommonAttentionMetadata

# A sequence joins the current bucket while its length is at least 1/_BUCKET_RATIO of the bucket's longest.
_BUCKET_RATIO = 1.5
# Below this length padding costs less than another SDPA call, so short sequences share one bucket.
_SMALL_LENGTH = 64


@dataclass(frozen=True)
class _Bucket:
    # First row of this bucket in the padded buffer; it spans num_seqs * max_len rows.
    row_start: int
    num_seqs: int
    max_len: int
    # [num_seqs, 1, 1, max_len] bool, True where a key is real; None when no key is padding.
    key_mask: torch.Tensor | None

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_seqs * self.max_len)


@dataclass(frozen=True)
class SdpaMetadata(AttentionMetadata):
    # [num_tokens] int64: the padded-buffer row of each packed token.
    scatter_index: torch.Tensor | None
    # Rows of the padded buffer; equals num_tokens when nothing is padded.
    padded_rows: int
    buckets: tuple[_Bucket, ...]


def plan_buckets(seq_lens: np.ndarray) -> list[np.ndarray]:
    """Groups sequence indices (longest first) so each group pads little."""
    order = np.argsort(-seq_lens, kind="stable")
    groups: list[np.ndarray] = []
    i = 0
    while i < len(order):
        longest = seq_lens[order[i]]
        j = i + 1
        while j < len(order) and (longest <= _SMALL_LENGTH or seq_lens[order[j]] * _BUCKET_RATIO >= longest):
            j += 1
        groups.append(order[i:j])
        i = j
    return groups


class SdpaBackend:
    name = "sdpa"

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> str | None:
        return None

    def build_metadata(self, common: CommonAttentionMetadata) -> SdpaMetadata:
        seq_lens = common.seq_lens_q_cpu
        device = common.cu_seqlens_q.device
        if len(seq_lens) == 1 or bool((seq_lens == seq_lens[0]).all()):
            # Equal lengths: the packed batch is already [num_seqs, length]; no scatter, no mask.
            bucket = _Bucket(0, len(seq_lens), int(seq_lens[0]), None)
            return SdpaMetadata(common, None, int(seq_lens.sum()), (bucket,))
        starts = np.zeros(len(seq_lens), dtype=np.int64)
        np.cumsum(seq_lens[:-1], out=starts[1:])
        base_row = np.empty(len(seq_lens), dtype=np.int64)
        buckets = []
        row = 0
        for group in plan_buckets(seq_lens):
            lens = seq_lens[group]
            max_len = int(lens[0])
            base_row[group] = row + np.arange(len(group)) * max_len
            mask = None
            if not common.is_causal and lens[-1] != max_len:
                # Right padding needs no mask under causal attention: real queries never see later keys.
                mask_np = np.arange(max_len)[None, :] < lens[:, None]
                mask = torch.from_numpy(mask_np[:, None, None, :]).to(device, non_blocking=True)
            buckets.append(_Bucket(row, len(group), max_len, mask))
            row += len(group) * max_len
        scatter = np.repeat(base_row - starts, seq_lens) + np.arange(int(seq_lens.sum()))
        scatter_t = torch.from_numpy(scatter).to(device, non_blocking=True)
        return SdpaMetadata(common, scatter_t, row, tuple(buckets))

    def forward(self, layer, q, k, v, kv_cache, meta: SdpaMetadata) -> torch.Tensor:
        if kv_cache is not None:
            raise NotImplementedError("the sdpa backend has no KV cache support yet")
        gqa = q.shape[1] != k.shape[1]
        if meta.scatter_index is None:
            (bucket,) = meta.buckets
            out = self._attend(layer, q, k, v, bucket, meta.is_causal, gqa)
            return out.transpose(1, 2).reshape(q.shape)
        qp, kp, vp = (self._scatter(x, meta) for x in (q, k, v))
        out = torch.empty_like(qp)
        for bucket in meta.buckets:
            rows = bucket.rows
            attended = self._attend(layer, qp[rows], kp[rows], vp[rows], bucket, meta.is_causal, gqa)
            out[rows].view(bucket.num_seqs, bucket.max_len, *q.shape[1:]).copy_(attended.transpose(1, 2))
        return out.index_select(0, meta.scatter_index)

    @staticmethod
    def _scatter(x: torch.Tensor, meta: SdpaMetadata) -> torch.Tensor:
        # Zeros, not garbage: a padded value row multiplies a zero weight, and 0 * NaN would leak.
        padded = x.new_zeros(meta.padded_rows, *x.shape[1:])
        return padded.index_copy_(0, meta.scatter_index, x)

    @staticmethod
    def _attend(layer, q, k, v, bucket: _Bucket, is_causal: bool, gqa: bool) -> torch.Tensor:
        """q/k/v rows of one bucket -> [num_seqs, heads, max_len, head_size]."""
        shape = (bucket.num_seqs, bucket.max_len)
        qb = q.view(*shape, *q.shape[1:]).transpose(1, 2)
        kb = k.view(*shape, *k.shape[1:]).transpose(1, 2)
        vb = v.view(*shape, *v.shape[1:]).transpose(1, 2)
        return F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=bucket.key_mask, is_causal=is_causal, scale=layer.scale, enable_gqa=gqa
        )
