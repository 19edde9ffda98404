"""Which metadata and which KV cache each attention layer of a model takes in a step.

The forward context (embedserv/forward_context.py) is a plain record by layer_index; the routing lives
here, decided once per model from its layers' kinds and groups and applied once per step by the model
runner:
- encoder layers take the encoder metadata (an encoder-decoder step's encoder inputs), else the first
  group's, and never a cache; windowed ones (Qwen2.5-VL's vision tower) the step's vision window metadata;
- cross layers of a KV-free step take the cross metadata (decoder queries over the packed encoder keys);
  with a cache they are a KV-cache group like any other;
- other layers take their KV-cache group's metadata, or under the prefill skip, from its first layer on,
  the kept rows' metadata of their group;
- a layer's cache is its own, or its `kv_source_layer`'s when it shares one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.layer import Attention, AttentionKind, attention_layers
from embedserv.attention.metadata import AttentionMetadata
from embedserv.attention.shared_kv import SharedKv
from embedserv.forward_context import ForwardContext
from embedserv.worker.prefill_skip import PrefillSkip


@dataclass(frozen=True)
class _Route:
    kind: AttentionKind
    kv_group: int
    cache_layer: int | None  # None: the layer never reads a cache (encoder layers)
    windowed: bool = False


class LayerRoutes:
    """A model's attention layers, by layer_index, as the per-step routing needs them.

    Per step the runner lays out every metadata object a layer can take in one tuple (the groups', the kept
    rows' groups', the encoder's, the cross one, none) and each layer's position in it comes from a table
    made once per kind of step: resolving is one tuple of lookups, no per-layer decision.
    """

    def __init__(self, layers: Sequence[Attention]) -> None:
        routes: list[_Route | None] = [None] * (max((layer.layer_index for layer in layers), default=-1) + 1)
        for layer in layers:
            cache_layer = None if layer.kind is AttentionKind.ENCODER else layer.cache_layer
            route = _Route(layer.kind, layer.kv_group, cache_layer, layer.windowed)
            if routes[layer.layer_index] not in (None, route):
                raise ValueError(f"two attention layers with layer_index {layer.layer_index} take different inputs")
            routes[layer.layer_index] = route
        self._routes = tuple(routes)
        grouped = [route.kv_group for route in routes if route is not None and route.kind is not AttentionKind.ENCODER]
        self.num_groups = max(grouped, default=0) + 1
        self.shares_kv = any(layer.kv_source_layer is not None for layer in layers)
        self.no_kv_caches: tuple[None, ...] = (None,) * len(routes)
        # (reads the KV cache, first layer of the prefill skip or None) -> each layer's position.
        self._positions: dict[tuple[bool, int | None], tuple[int, ...]] = {}

    def kv_caches(self, tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """By layer_index, the cache each layer reads: `tensors` holds one per owning layer (worker/kv_cache.py)."""
        return tuple(
            None if route is None or route.cache_layer is None else tensors[route.cache_layer] for route in self._routes
        )

    def context(
        self,
        backend: AttentionBackend,
        attn_metadata: Sequence[AttentionMetadata],
        layer_kv_caches: tuple[torch.Tensor | None, ...] | None = None,
        encoder_metadata: AttentionMetadata | None = None,
        cross_metadata: AttentionMetadata | None = None,
        skip: PrefillSkip | None = None,
        window_metadata: AttentionMetadata | None = None,
    ) -> ForwardContext:
        """The step's forward context. `attn_metadata`: one per KV-cache group, or one for all of them (every
        KV-free step); `layer_kv_caches`: from `kv_caches(...)`, None on KV-free steps; `window_metadata`: the
        vision windows (worker/image_inputs.py), for windowed encoder layers."""
        groups = self._per_group(attn_metadata)
        kept = self._per_group(skip.attn_metadata) if skip is not None else groups
        encoder = encoder_metadata if encoder_metadata is not None else groups[0]
        choices = (*groups, *kept, encoder, cross_metadata, None, window_metadata)
        reads_kv_cache = layer_kv_caches is not None
        kind_of_step = (reads_kv_cache, skip.first_layer if skip is not None else None)
        positions = self._positions.get(kind_of_step)
        if positions is None:
            positions = self._positions[kind_of_step] = self._layout(*kind_of_step)
        return ForwardContext(
            attn_backend=backend,
            attn_metadata=tuple([choices[i] for i in positions]),
            kv_caches=layer_kv_caches if reads_kv_cache else self.no_kv_caches,
            shared_kv=SharedKv() if self.shares_kv and not reads_kv_cache else None,
        )

    def _per_group(self, metadata: Sequence[AttentionMetadata]) -> tuple[AttentionMetadata, ...]:
        if len(metadata) == 1:
            return tuple(metadata) * self.num_groups
        if len(metadata) != self.num_groups:
            raise ValueError(f"{len(metadata)} attention metadata objects for {self.num_groups} KV-cache groups")
        return tuple(metadata)

    def _layout(self, reads_kv_cache: bool, skip_layer: int | None) -> tuple[int, ...]:
        """Each layer's position in the step's choices: groups 0..G-1, kept rows' groups G..2G-1, then the
        encoder metadata, the cross metadata, None (no layer at that index) and the vision windows'."""
        count = self.num_groups
        encoder, cross, missing, window = 2 * count, 2 * count + 1, 2 * count + 2, 2 * count + 3
        positions = []
        for index, route in enumerate(self._routes):
            if route is None:
                positions.append(missing)
            elif route.windowed:
                positions.append(window)
            elif route.kind is AttentionKind.ENCODER:
                positions.append(encoder)
            elif route.kind is AttentionKind.CROSS and not reads_kv_cache:
                positions.append(cross)
            elif skip_layer is not None and index >= skip_layer:
                positions.append(count + route.kv_group)
            else:
                positions.append(route.kv_group)
        return tuple(positions)


def forward_context_for(
    layers: nn.Module | Sequence[Attention],
    attn_backend: AttentionBackend,
    attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
    kv_caches: Sequence[torch.Tensor | None] | None = None,
    encoder_metadata: AttentionMetadata | None = None,
    cross_metadata: AttentionMetadata | None = None,
    skip: PrefillSkip | None = None,
    window_metadata: AttentionMetadata | None = None,
) -> ForwardContext:
    """The context a runner would set for these layers (a model's, or a list), for code that runs layers or a
    model without a runner (tests, benchmarks). `kv_caches`: one per owning layer by layer_index, as
    worker/kv_cache.py allocates them; empty or None on KV-free steps."""
    found = attention_layers(layers) if isinstance(layers, nn.Module) else list(layers)
    routes = LayerRoutes(found)
    if not isinstance(attn_metadata, (tuple, list)):
        attn_metadata = (attn_metadata,)
    return routes.context(
        attn_backend,
        attn_metadata,
        routes.kv_caches(kv_caches) if kv_caches else None,
        encoder_metadata,
        cross_metadata,
        skip,
        window_metadata,
    )
