"""The forward context: what attention layers need that the model's signature does not carry.

A plain record the model runner sets around one forward pass: each attention layer's metadata and cache,
resolved once per step by layer_index (worker/layer_routes.py), so model code stays
`forward(input_ids, positions)` and a layer reads only its own entry. Nothing here knows layer kinds or
groups. A ContextVar keeps two engines running forward passes in different threads apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from embedserv.attention.backends.base import AttentionBackend
    from embedserv.attention.metadata import AttentionMetadata
    from embedserv.attention.shared_kv import SharedKv


@dataclass(frozen=True)
class ForwardContext:
    attn_backend: AttentionBackend
    # By layer_index: the metadata that layer attends with. None where no layer has that index, and for a
    # cross layer in a KV-free step without encoder inputs (it has nothing to attend to).
    attn_metadata: tuple[AttentionMetadata | None, ...]
    # By layer_index: the cache that layer reads (its KV source's when it shares one) and writes; None for
    # every layer on KV-free steps and for encoder layers.
    kv_caches: tuple[torch.Tensor | None, ...]
    # KV-free steps of a model whose layers share KV: where each source layer leaves its k and v for the
    # layers that read them (a fresh one per step). None otherwise.
    shared_kv: SharedKv | None = None
    # Steps of a model served with --lora adapters where a row runs one: which rows run which adapter, a
    # models/lora.AdapterRows (typed loosely: this record imports no model code). Read by LoraLinear only.
    # None: every row runs the base weights.
    lora: object | None = None


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
