"""The forward context: what attention layers need that the model's signature does not carry.

The model runner sets it around one forward pass. Each Attention layer finds its metadata and (with a KV
cache) its cache here by its kind, KV-cache group and layer index, so model code stays
`forward(input_ids, positions)`. A ContextVar keeps two engines running forward passes in different
threads apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
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
    # --kv-sharing-fast-prefill: the layers from `skip.first_layer` on run only `skip.rows` (None: off).
    skip: PrefillSkip | None = None
    # KV-free steps: the k and v of each KV source layer (attention/layer.py), for the layers sharing them.
    shared_kv: dict = field(default_factory=dict, compare=False, repr=False)

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
        if self.skip is not None and layer.layer_index >= self.skip.first_layer:
            return self.skip.attn_metadata[layer.kv_group if len(self.skip.attn_metadata) > 1 else 0]
        return self.attn_metadata[layer.kv_group if len(self.attn_metadata) > 1 else 0]

    def kv_cache_for(self, layer: Attention) -> torch.Tensor | None:
        if not self.kv_caches or layer.kind == "encoder":
            return None
        return self.kv_caches[layer.cache_layer]


@dataclass(frozen=True)
class PrefillSkip:
    """The layers after the last one that writes KV (they only read it) run only the rows whose output is
    read: each sampled row, or each last token a last-token head pools. Their queries are those rows; their
    keys stay every token (read from the cache, or the source layers' k and v on KV-free steps)."""

    # Attention layer_index of the first layer that runs the kept rows (the model's `prefill_skip_layer`).
    first_layer: int
    # [num_kept] int64 (padded on CPU, embedserv/padding.py): the kept rows, indices into the step's packed
    # tokens, in packed order.
    rows: torch.Tensor
    # Per KV-cache group (as attn_metadata): each kept sequence's kept queries over all of its keys.
    attn_metadata: Sequence[AttentionMetadata]


_current: ContextVar[ForwardContext | None] = ContextVar("embedserv_forward_context", default=None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def prefill_skip_rows() -> torch.Tensor | None:
    """For a model at its `prefill_skip_layer`: the rows the remaining layers run (index_select hidden
    states, positions' cos/sin and any per-token input by them), or None when every row runs on."""
    skip = get_forward_context().skip
    return skip.rows if skip is not None else None


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context(...)")
    return context
