"""KV sharing on KV-free steps: with no cache to read another layer's keys and values from, a KV source
layer hands its step's k and v to the layers that share them through this object."""

from __future__ import annotations

import torch


class SharedKv:
    """One step's hand-over, keyed by the source layer's layer_index. The model runner makes a fresh one per
    KV-free step and puts it in the forward context; attention layers put and get (attention/layer.py)."""

    __slots__ = ("_by_source",)

    def __init__(self) -> None:
        self._by_source: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, source_layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._by_source[source_layer] = (k, v)

    def get(self, source_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._by_source.get(source_layer)
        if found is None:
            # A source runs before its readers (link_kv_sharing checks the order), so this is a wiring bug.
            raise RuntimeError(f"attention layer {source_layer} left no k and v this step for the layers sharing them")
        return found
