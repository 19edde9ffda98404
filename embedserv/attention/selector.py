"""Picks the attention backend for a device, dtype and head size; a forced name must be able to run."""

from __future__ import annotations

import torch

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.errors import ConfigError

# Fastest first: the selector takes the first that can run.
BACKENDS: dict[str, type[AttentionBackend]] = {
    SdpaBackend.name: SdpaBackend,
    NaiveBackend.name: NaiveBackend,
}


def select_backend(
    requested: str | None, device: torch.device, dtype: torch.dtype, head_size: int
) -> AttentionBackend:
    if requested is not None:
        backend_cls = BACKENDS.get(requested)
        if backend_cls is None:
            raise ConfigError(
                f"unknown --attention-backend {requested!r}; choose one of {', '.join(BACKENDS)}"
            )
        reason = backend_cls.unsupported_reason(device, dtype, head_size)
        if reason is not None:
            raise ConfigError(f"--attention-backend {requested} cannot run here: {reason}")
        return backend_cls()
    for backend_cls in BACKENDS.values():
        if backend_cls.unsupported_reason(device, dtype, head_size) is None:
            return backend_cls()
    raise ConfigError(f"no attention backend runs on {device} with {dtype} and head size {head_size}")
