"""Sliding-window attention: which keys a query sees, in the terms every backend shares.

A layer's `sliding_window` W lets the query at position p of its sequence see the key at position j only
when |p - j| < W (and j <= p when causal). Where a sequence has fewer queries than keys (paged steps, the
prefill skip's suffix queries) its queries are the last len_q of its len_k positions.

A window at least as long as a sequence hides none of its keys: backends drop it there (`window_within`)
so that such layers and sequences keep the no-window path, with no mask and the same kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from embedserv.attention.backends.base import AttentionLayer


def window_within(layer: AttentionLayer, longest: int) -> int | None:
    """The layer's window where it hides a key of a sequence of `longest` positions, else None."""
    window = layer.sliding_window
    return window if window is not None and window < longest else None


def in_window(q_pos, k_pos, window):
    """True where |q_pos - k_pos| < window; tensors that broadcast (window an int or a tensor)."""
    return (q_pos - k_pos < window) & (k_pos - q_pos < window)


def visible_keys(len_q: int, len_k: int, is_causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """[len_q, len_k] bool, True where a query sees a key; the queries are the last len_q positions."""
    q_pos = torch.arange(len_k - len_q, len_k, device=device)[:, None]
    k_pos = torch.arange(len_k, device=device)
    seen = k_pos <= q_pos if is_causal else torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    return seen if window is None else seen & in_window(q_pos, k_pos, window)


def flash_window(window: int | None, is_causal: bool) -> tuple[int, int]:
    """flash-attention's `window_size=(left, right)`: a query at p sees keys p - left .. p + right (-1:
    unbounded), its position aligned at the end of the keys as ours."""
    if window is None:
        return (-1, 0) if is_causal else (-1, -1)
    return (window - 1, 0 if is_causal else window - 1)


def refuse_biased_window(layer: AttentionLayer, backend: str) -> None:
    """No model has both T5's bias and a window, and the selector refuses the pair (selector.py);
    reaching a backend with both is a bug, not a wrong answer."""
    if layer.sliding_window is not None and getattr(layer, "relative_bias", None) is not None:
        raise NotImplementedError(
            f"attention layer {layer.layer_index}: the {backend} attention backend does not combine T5's "
            "relative position bias with a sliding window"
        )


def refuse_biased_suffix(layer: AttentionLayer, backend: str) -> None:
    """The prefill skip serves decoder models that share KV; T5 shares none, so no step has T5's bias
    over suffix queries and the backends do not place it there."""
    if getattr(layer, "relative_bias", None) is not None:
        raise NotImplementedError(
            f"attention layer {layer.layer_index}: the {backend} attention backend does not add T5's "
            "relative position bias to suffix queries (the prefill skip)"
        )
