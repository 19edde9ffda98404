"""Models constructed on the meta device with their parameter initializers skipped.

An initializer (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) on a meta tensor runs torch's Python
reference, which imports torch._dynamo on first use: about 1.4 s in every process that reads a model's layout or
builds one (the server, each front end, each worker). Nothing reads those values: the layout needs shapes only,
and built models take every parameter from the checkpoint (weights.load_into refuses one that lacks any).

The initializers of torch.nn.init are wrapped once, in place; outside `meta_model()`, and in any other thread
meanwhile, each wrapper runs the initializer it wraps.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch

_INITIALIZERS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
_skipping = threading.local()


def _skippable(initializer: Callable) -> Callable:
    @functools.wraps(initializer)
    def initialize(tensor, *args, **kwargs):
        if getattr(_skipping, "on", False):
            return tensor
        return initializer(tensor, *args, **kwargs)

    initialize.skippable = True  # type: ignore[attr-defined]
    return initialize


def _wrap_initializers() -> None:
    for name in _INITIALIZERS:
        initializer = getattr(torch.nn.init, name, None)
        if initializer is not None and not getattr(initializer, "skippable", False):
            setattr(torch.nn.init, name, _skippable(initializer))


@contextlib.contextmanager
def meta_model() -> Iterator[None]:
    """Modules constructed inside are on the meta device, their parameters left uninitialized."""
    _wrap_initializers()
    before = getattr(_skipping, "on", False)
    _skipping.on = True
    try:
        with torch.device("meta"):
            yield
    finally:
        _skipping.on = before
