"""Picks the attention backend for a model on a device; a forced name must be able to run there.

Capability checks live here, not in the backends: each backend computes one function, and this file
says where each can compute it. The order of PREFERENCE is the speed order measured in
benchmarks/attention_backends.py (docs/performance-history.md); the selector takes the first that can run.
"""

from __future__ import annotations

import importlib.util
import inspect
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedserv import cpu_isa
from embedserv.attention.backends.base import AttentionBackend
from embedserv.errors import ConfigError


@dataclass(frozen=True)
class AttentionSpec:
    """What a model needs from attention on one device."""

    device: torch.device
    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    is_causal: bool
    # T5: a learned per-head bias added to the scores by relative position (attention/relative_bias.py).
    relative_bias: bool = False
    # At least one layer attends within a sliding window (Attention.sliding_window).
    sliding_window: bool = False
    # DeBERTa-v2/v3: a content-dependent relative position bias (attention/disentangled.py).
    disentangled: bool = False
    # The model generates: its steps decode one token a sequence over the paged KV cache.
    generates: bool = False


# Head sizes cpu_varlen runs when forced (the kernel computes any).
CPU_VARLEN_HEAD_SIZES = (32, 128)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is missing
        return False


def _flash_kernel_reason(spec: AttentionSpec, what: str) -> str | None:
    """The limits the flash-attention 2 kernels share (torch's varlen and the flash-attn package)."""
    if spec.device.type != "cuda":
        return f"{what} runs on CUDA only (device is {spec.device})"
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"{what} needs float16 or bfloat16, not {str(spec.dtype).removeprefix('torch.')}"
    if spec.head_size > 256 or spec.head_size % 8:
        return f"{what} needs a head size that is a multiple of 8 up to 256, not {spec.head_size}"
    major, _ = torch.cuda.get_device_capability(spec.device)
    if major < 8:
        return f"{what} needs an Ampere or newer GPU (compute capability 8.0+)"
    return None


def _relative_bias_reason(what: str) -> str:
    """Why a kernel without a per-head score bias cannot run a T5 or MPNet model. Checked before the device
    and packages: no GPU or install would change it."""
    return f"{what} cannot add the relative position bias of T5 and MPNet; use sdpa, flex or naive"


def _disentangled_reason(what: str) -> str:
    """Why a kernel without a score bias cannot run DeBERTa; checked before the device and packages too."""
    return f"{what} cannot add DeBERTa's disentangled position bias; use sdpa, flex or naive"


def _varlen_takes_window() -> bool:
    """Whether this torch's varlen_attn takes `window_size` (2.10 has only `is_causal`). Read from the
    signature without importing the backend (varlen.TAKES_WINDOW says the same)."""
    from torch.nn.attention.varlen import varlen_attn

    return "window_size" in inspect.signature(varlen_attn).parameters


def _naive_reason(spec: AttentionSpec) -> str | None:
    return None


def _sdpa_reason(spec: AttentionSpec) -> str | None:
    return None


def _flex_reason(spec: AttentionSpec) -> str | None:
    if not _has_module("torch.nn.attention.flex_attention"):
        return f"torch {torch.__version__} has no FlexAttention"
    if spec.head_size < 16 or spec.head_size & (spec.head_size - 1):
        return f"FlexAttention's compiled kernels need a power-of-two head size of 16 or more, not {spec.head_size}"
    if spec.device.type == "cpu":
        if spec.dtype == torch.float16:
            return "FlexAttention on CPU runs float32 and bfloat16, not float16"
        if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
            return "FlexAttention on CPU is compiled to C++ and no C++ compiler is on PATH"
    elif spec.device.type == "cuda":
        if not _has_module("triton"):
            return "FlexAttention on CUDA is compiled with Triton, which is not installed"
    else:
        return f"FlexAttention runs on CPU and CUDA, not {spec.device.type}"
    return None


def _varlen_reason(spec: AttentionSpec) -> str | None:
    if spec.relative_bias:
        return _relative_bias_reason("torch.nn.attention.varlen")
    if spec.disentangled:
        return _disentangled_reason("torch.nn.attention.varlen")
    if not _has_module("torch.nn.attention.varlen"):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10+)"
    if spec.sliding_window and not _varlen_takes_window():
        return f"torch {torch.__version__}'s varlen_attn takes no window_size: it cannot run a sliding window"
    return _flash_kernel_reason(spec, "torch.nn.attention.varlen")


def _cpu_varlen_reason(spec: AttentionSpec) -> str | None:
    if spec.relative_bias:
        return _relative_bias_reason("cpu_varlen")
    if spec.disentangled:
        return _disentangled_reason("cpu_varlen")
    if spec.device.type != "cpu":
        return f"cpu_varlen runs on CPU only (device is {spec.device})"
    if spec.dtype not in (torch.float32, torch.bfloat16):
        return f"cpu_varlen runs float32 and bfloat16, not {str(spec.dtype).removeprefix('torch.')}"
    if not CPU_VARLEN_HEAD_SIZES[0] <= spec.head_size <= CPU_VARLEN_HEAD_SIZES[1]:
        low, high = CPU_VARLEN_HEAD_SIZES
        return f"cpu_varlen serves head sizes {low} to {high} (measured there), not {spec.head_size}"
    from embedserv.attention.backends.cpu_varlen_kernel import compiler

    if compiler() is None:
        return "cpu_varlen is compiled at first use and no C++ compiler is on PATH"
    return None


def _flash_attn_reason(spec: AttentionSpec) -> str | None:
    if spec.relative_bias:
        return _relative_bias_reason("flash-attn")
    if spec.disentangled:
        return _disentangled_reason("flash-attn")
    if not _has_module("flash_attn"):
        return "the flash-attn package is not installed (pip install 'embedserv[flash]')"
    return _flash_kernel_reason(spec, "flash-attn")


# name -> (module that defines the backend class, class name, capability check). Backends import lazily:
# flash-attn and FlexAttention cost seconds to import and may be missing.
_REGISTRY: dict[str, tuple[str, str, Callable[[AttentionSpec], str | None]]] = {
    "flash_attn": ("embedserv.attention.backends.flash_attn", "FlashAttnBackend", _flash_attn_reason),
    "varlen": ("embedserv.attention.backends.varlen", "VarlenBackend", _varlen_reason),
    "cpu_varlen": ("embedserv.attention.backends.cpu_varlen", "CpuVarlenBackend", _cpu_varlen_reason),
    "sdpa": ("embedserv.attention.backends.sdpa", "SdpaBackend", _sdpa_reason),
    "flex": ("embedserv.attention.backends.flex", "FlexBackend", _flex_reason),
    "naive": ("embedserv.attention.backends.naive", "NaiveBackend", _naive_reason),
}

# Fastest first, per device type. On CPU the per-length SDPA calls beat compiled FlexAttention on every mix
# measured; on CUDA the flash kernels take the packed batch in one launch. cpu_varlen (the C++ kernel for short
# heads, compiled at its first use on a machine) comes first only on the CPU classes, dtypes and head sizes where it
# measured faster than sdpa (cpu_isa.cpu_varlen_default); elsewhere it runs when asked for.
PREFERENCE = {
    "cuda": ("flash_attn", "varlen", "sdpa", "flex", "naive"),
    "cpu": ("cpu_varlen", "sdpa", "flex", "naive"),
}


def _not_default_reason(name: str, spec: AttentionSpec) -> str | None:
    """Why a backend that can run `spec` is still not chosen unasked; None: it is."""
    dtype = str(spec.dtype).removeprefix("torch.")
    if name == "cpu_varlen" and not cpu_isa.cpu_varlen_default(dtype, spec.head_size, spec.generates):
        what = f"a generating model's {dtype}" if spec.generates else f"{dtype} heads of {spec.head_size}"
        level = cpu_isa.detect().level
        return f"chosen unasked only where it measured faster than sdpa, not for {what} on this CPU ({level})"
    return None


def unsupported_reason(name: str, spec: AttentionSpec) -> str | None:
    """None when backend `name` can run `spec`, else why not."""
    if spec.relative_bias and spec.sliding_window:
        # Refused, not ignored: no model has both, sdpa and flex (the backends that add the bias) do not
        # place it inside a window, and dropping either would give wrong answers silently.
        return "T5's relative position bias does not combine with a sliding window"
    if spec.disentangled and (spec.sliding_window or spec.relative_bias or spec.is_causal):
        # The Attention layer refuses these too: DeBERTa is a bidirectional encoder with neither.
        return "DeBERTa's disentangled attention serves bidirectional encoders without a window or T5's bias"
    return _REGISTRY[name][2](spec)


def backend_class(name: str) -> type[AttentionBackend]:
    module, class_name, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), class_name)


def select_backend(requested: str | None, spec: AttentionSpec) -> AttentionBackend:
    if requested is not None:
        if requested not in _REGISTRY:
            raise ConfigError(f"unknown --attention-backend {requested!r}; choose one of {', '.join(_REGISTRY)}")
        reason = unsupported_reason(requested, spec)
        if reason is not None:
            raise ConfigError(f"--attention-backend {requested} cannot run here: {reason}")
        return backend_class(requested)()
    reasons = []
    for name in PREFERENCE.get(spec.device.type, ("sdpa", "naive")):
        reason = unsupported_reason(name, spec) or _not_default_reason(name, spec)
        if reason is None:
            return backend_class(name)()
        reasons.append(f"{name}: {reason}")
    raise ConfigError(f"no attention backend runs here: {'; '.join(reasons)}")
