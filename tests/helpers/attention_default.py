"""The attention backend this machine picks unasked for a spec: cpu_varlen where its CPU class measured it faster
than sdpa (cpu_isa.cpu_varlen_default) and it can be built here, else sdpa."""

from __future__ import annotations

from embedserv import cpu_isa
from embedserv.attention.selector import AttentionSpec, unsupported_reason


def cpu_default(spec: AttentionSpec) -> str:
    dtype = str(spec.dtype).removeprefix("torch.")
    chosen = cpu_isa.cpu_varlen_default(dtype, spec.head_size, spec.generates)
    chosen = chosen and unsupported_reason("cpu_varlen", spec) is None
    return "cpu_varlen" if chosen else "sdpa"
