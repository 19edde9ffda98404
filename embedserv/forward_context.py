"""The forward context: what attention layers need that the model's signature does not carry.

The model runner sets it around one forward pass. Each Attention layer finds its metadata and (with a KV
cache) its cache here by its kind, KV-cache group and layer index, so model code stays
`forward(input_ids, positions)`. A ContextVar keeps two engines running forward passes in different
threads apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    import torch

    from embedserv.attention.backends.base import AttentionBackend
    from embedserv.attention.layer import Attention
    from embedserv.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    attn_backend: AttentionBackend
    # One metadata per KV-cache group (indexed by a layer's kv_group); on KV-free steps one for every layer.
    attn_metadata: Sequence[AttentionMetadata]
    # One cache per attention layer, by layer_index (None for a layer that owns none: it reads its KV
    # source's); empty on KV-free steps.
    kv_caches: Sequence[torch.Tensor | None] = ()
    # Encoder layers of an encoder-decoder model attend over the encoder inputs, which have their own
    # packing; None when the step has no encoder inputs (then encoder layers use attn_metadata[0]).
    encoder_metadata: AttentionMetadata | None = None
    # Cross layers of a KV-free step (prefill-only encoder-decoder work): decoder queries over the
    # packed encoder keys. With a KV cache, cross layers use their group's entry of attn_metadata.
    cross_metadata: AttentionMetadata | None = None

    def __post_init__(self) -> None:
        # One metadata object (every KV-free step, most tests) stands for a one-group tuple.
        if not isinstance(self.attn_metadata, (tuple, list)):
            object.__setattr__(self, "attn_metadata", (self.attn_metadata,))

    def metadata_for(self, layer: Attention) -> AttentionMetadata:
        if layer.kind == "encoder":
            return self.encoder_metadata if self.encoder_metadata is not None else self.attn_metadata[0]
        if layer.kind == "cross" and not self.kv_caches:
            if self.cross_metadata is None:
                raise RuntimeError("a cross-attention layer ran in a step without encoder inputs")
            return self.cross_metadata
        return self.attn_metadata[layer.kv_group if len(self.attn_metadata) > 1 else 0]

    def kv_cache_for(self, layer: Attention) -> torch.Tensor | None:
        if not self.kv_caches or layer.kind == "encoder":
            return None
        return self.kv_caches[layer.cache_layer]


_current: ContextVar[ForwardContext | None] = ContextVar("embedserv_forward_context", default=None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context(...)")
    return context
