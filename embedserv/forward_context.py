"""The forward context: what attention layers need that the model's signature does not carry.

The model runner sets it around one forward pass; each Attention layer reads its metadata, backend and
(in generation) its KV cache here, so model code stays `forward(input_ids, positions)`.
A ContextVar keeps two engines running forward passes in different threads apart.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    import torch

    from embedserv.attention.backends.base import AttentionBackend
    from embedserv.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    attn_backend: AttentionBackend
    # One cache tensor per attention layer, indexed by layer_index; empty on KV-free paths.
    kv_caches: Sequence[torch.Tensor] = ()


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
