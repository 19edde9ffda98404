"""The one attention layer every model uses; the only reader of the forward context."""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from embedserv.attention.disentangled import DisentangledPositions, PositionProjections
from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.forward_context import get_forward_context


class AttentionKind(str, Enum):
    # Bidirectional over the (encoder) input, never a KV cache.
    ENCODER = "encoder"
    # Self-attention of a decoder (or of an encoder-only model): causal or not as the metadata says;
    # paged KV when generating.
    DECODER = "decoder"
    # Decoder queries over keys and values computed once from the encoder output (a fixed KV group).
    CROSS = "cross"


class Attention(nn.Module):
    """Attention over the packed batch described by the forward context.

    q: [num_tokens, num_heads * head_size]; k, v: [num_tokens, num_kv_heads * head_size], or both None for
    a layer with a `kv_source_layer`: it has no K/V projections, reads that layer's cache, writes nothing
    and owns no cache. Whether attention is causal comes from the metadata, so one model class serves both.

    A CROSS layer's q holds the decoder tokens and its k, v the encoder tokens of the sequences whose
    encoder runs in this step (a request's first step), or both None when no encoder runs: its keys are
    then all in the cross KV cache (or, without a cache, there is nothing to attend to). `relative_bias`
    (T5) is added to the scores by distance; only self-attention layers carry one.

    `sliding_window` W (None: every key): a query at position p of its sequence sees the key at position j
    only when |p - j| < W (and j <= p when causal, as always). Queries and keys are positions of one
    sequence: with a paged cache, or on a KV-free step whose queries are fewer than their keys (the
    prefill skip), queries are the last len_q of the len_k positions.

    `disentangled` (DeBERTa-v2/v3): the layer adds a content-dependent relative position bias
    (attention/disentangled.py) made from the position projections each call passes as `positions`
    ([2 * span, num_heads * head_size] each, or None for a term the model does not use). Encoder layers
    only: bidirectional, no window, no T5 bias.

    KV sharing on KV-free steps (no cache to read): a source layer (one a later layer names as its
    `kv_source_layer`; `is_kv_source`, set by `link_kv_sharing`) puts its step's k and v in the context's
    SharedKv (attention/shared_kv.py), and the sharing layer attends over them.

    `windowed` (encoder layers only): the layer attends within the step's vision windows instead of whole
    images (Qwen2.5-VL's vision tower: worker/layer_routes.py gives it the window metadata).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        layer_index: int = 0,
        kind: AttentionKind = AttentionKind.DECODER,
        kv_group: int = 0,
        kv_source_layer: int | None = None,
        relative_bias: RelativePositionBias | None = None,
        sliding_window: int | None = None,
        disentangled: DisentangledPositions | None = None,
        windowed: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {self.num_kv_heads} KV head groups")
        self.scale = scale if scale is not None else head_size**-0.5
        self.layer_index = layer_index
        self.kind = AttentionKind(kind)
        self.kv_group = kv_group
        self.kv_source_layer = kv_source_layer
        if relative_bias is not None and self.kind is AttentionKind.CROSS:
            raise ValueError("cross-attention takes no relative position bias")
        if sliding_window is not None and (sliding_window < 1 or self.kind is AttentionKind.CROSS):
            raise ValueError(f"a sliding window of {sliding_window} on a {self.kind.value} attention layer")
        self.sliding_window = sliding_window
        if disentangled is not None and (
            self.kind is not AttentionKind.ENCODER or sliding_window is not None or relative_bias is not None
        ):
            raise ValueError("disentangled attention serves encoder layers without a window or T5's bias")
        self.disentangled = disentangled
        if windowed and self.kind is not AttentionKind.ENCODER:
            raise ValueError(f"a {self.kind.value} attention layer attends within no vision windows")
        self.windowed = windowed
        self.is_kv_source = False
        # Not a submodule: the stack owns it (one table for all its layers).
        self.__dict__["relative_bias"] = relative_bias

    @property
    def owns_kv_cache(self) -> bool:
        return self.kind is not AttentionKind.ENCODER and self.kv_source_layer is None

    @property
    def cache_layer(self) -> int:
        """The layer whose cache this one reads (its own unless it shares another's)."""
        return self.layer_index if self.kv_source_layer is None else self.kv_source_layer

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        positions: PositionProjections | None = None,
    ) -> torch.Tensor:
        if (positions is None) != (self.disentangled is None):
            raise ValueError(f"attention layer {self.layer_index}: position projections go with disentangled attention")
        context = get_forward_context()
        # The runner resolved both for this layer once per step (worker/layer_routes.py).
        meta = context.attn_metadata[self.layer_index]
        kv_cache = context.kv_caches[self.layer_index]
        if meta is None:
            # The one way a routed layer gets none: a cross layer in a KV-free step without encoder inputs.
            raise RuntimeError(f"{self.kind.value} attention layer {self.layer_index} ran in a step without its inputs")
        # Padding rows (models/layers.py) follow the real ones: the backend never sees them.
        rows, num_queries = q.shape[0], meta.common.num_query_rows
        if k is not None:
            k = _real_rows(k, meta.common.num_key_rows).view(-1, self.num_kv_heads, self.head_size)
            v = _real_rows(v, meta.common.num_key_rows).view(-1, self.num_kv_heads, self.head_size)
        if kv_cache is None and self.kind is not AttentionKind.CROSS:
            if self.kv_source_layer is not None:
                k, v = context.shared_kv.get(self.kv_source_layer)
            elif self.is_kv_source:
                context.shared_kv.put(self.layer_index, k, v)
        if positions is not None:
            positions = PositionProjections(
                *(
                    None if p is None else p.view(-1, self.num_heads, self.head_size)
                    for p in (positions.keys, positions.queries)
                )
            )
        out = context.attn_backend.forward(
            self,
            _real_rows(q, num_queries).view(-1, self.num_heads, self.head_size),
            k,
            v,
            kv_cache,
            meta,
            positions=positions,
        ).reshape(-1, self.num_heads * self.head_size)
        if num_queries < rows:
            # Zeros, not garbage: the padding rows run on through the layers after this one.
            out = torch.cat((out, out.new_zeros(rows - num_queries, out.shape[1])))
        return out


def _real_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` rows (`x` itself when it has no padding rows: off CPU)."""
    return x if x.shape[0] == count else x[:count]


def attention_layers(model: nn.Module) -> list[Attention]:
    """A model's attention layers by layer_index."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_index)


def link_kv_sharing(layers: list[Attention]) -> None:
    """Marks the layers that others read the KV of (`is_kv_source`); a model calls it once it has built
    its attention layers. A source must come before its readers and own its cache."""
    by_index = {layer.layer_index: layer for layer in layers}
    for layer in layers:
        if layer.kv_source_layer is None:
            continue
        source = by_index.get(layer.kv_source_layer)
        if source is None or source.kv_source_layer is not None or source.layer_index >= layer.layer_index:
            raise ValueError(
                f"attention layer {layer.layer_index} reads the KV of layer {layer.kv_source_layer}, "
                "which is not an earlier layer with a cache of its own"
            )
        source.is_kv_source = True
