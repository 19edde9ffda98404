"""What this CPU computes natively, and the CPU constants that depend on it.

Machines differ: an AVX2-only EPYC emulates bfloat16 (6x slower than float32 there) and saturates
int8 products of 8-bit weights, while AVX-512 parts with avx512_bf16 or AMX run bfloat16 in
hardware and VNNI multiplies int8 exactly. `detect()` reads the flags once; everything that depends on
them asks here, so tests fake one probe (monkeypatch `detect`) to exercise another machine.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

# Flags that matter here, in the order the start-up log names them.
_NAMED_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
    "avx512_fp16",
    "amx_fp16",
)

# bfloat16 emulated (no avx512_bf16/AMX): MiniLM served 772 against 4,449 tokens/s in float32 on an AVX2
# EPYC, about 6x slower (docs/performance-history.md, issue 22); float16 has no fast path without avx512_fp16/AMX-FP16.
EMULATED_BF16_SLOWDOWN = 6


@dataclass(frozen=True)
class CpuIsa:
    model_name: str
    flags: frozenset[str]

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def native_fp16(self) -> bool:
        return bool({"avx512_fp16", "amx_fp16"} & self.flags)

    @property
    def vnni(self) -> bool:
        """int8 dot products that accumulate in 32 bits (no 16-bit intermediate that can saturate)."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & self.flags)

    @property
    def level(self) -> str:
        """The coarse class tuned constants are keyed by: amx, avx512_bf16, avx512, avx2 or baseline."""
        if "amx_bf16" in self.flags:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        return "avx2" if "avx2" in self.flags else "baseline"

    def summary(self) -> str:
        present = [flag for flag in _NAMED_FLAGS if flag in self.flags]
        bf16 = "native bf16" if self.native_bf16 else "bf16 emulated"
        int8 = "VNNI" if self.vnni else "without VNNI"
        return f"{self.model_name}: {' '.join(present) or 'no AVX2'} ({bf16}, int8 {int8})"


def _read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> CpuIsa:
    """The first core's model name and flags (cores of one machine report the same)."""
    fields: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    return CpuIsa(name, frozenset(fields.get("flags", "").split()))


# ONEDNN_MAX_CPU_ISA (oneDNN's documented values) -> the flags above that oneDNN may still use. Capped, oneDNN
# runs the lower ISA's kernels (ONEDNN_VERBOSE names them: `gemm:jit` under AVX2, `brg_matmul:avx512_core`
# under AVX512_CORE), so the probe must say so too: 8-bit int8 weights would saturate under a cap without
# VNNI on a VNNI machine. It is also how a test or benchmark runs this machine as a lower class.
_AVX512 = frozenset({"avx2", "avx512f"})
_ONEDNN_CAPS = {
    "SSE41": frozenset(),
    "AVX": frozenset(),
    "AVX2": frozenset({"avx2"}),
    "AVX2_VNNI": frozenset({"avx2", "avx_vnni"}),
    "AVX2_VNNI_2": frozenset({"avx2", "avx_vnni"}),
    "AVX512_CORE": _AVX512,
    "AVX512_CORE_VNNI": _AVX512 | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
    "AVX512_CORE_FP16": _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16"},
    "AVX512_CORE_AMX": _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8"},
}
_ONEDNN_CAPS["AVX10_1_512"] = _ONEDNN_CAPS["AVX512_CORE_FP16"]
_ONEDNN_CAPS["AVX10_1_512_AMX"] = _ONEDNN_CAPS["AVX512_CORE_AMX"]


def capped(isa: CpuIsa, cap: str | None) -> CpuIsa:
    """`isa` as oneDNN sees it under ONEDNN_MAX_CPU_ISA=`cap`: the named flags above the cap dropped, the cap
    named. No cap, ALL, DEFAULT or a value not listed here (AMX_FP16 and later) leave it as it is."""
    allowed = _ONEDNN_CAPS.get((cap or "").strip().upper())
    if allowed is None:
        return isa
    return CpuIsa(f"{isa.model_name} (ONEDNN_MAX_CPU_ISA={cap})", isa.flags - (set(_NAMED_FLAGS) - allowed))


@functools.cache
def detect() -> CpuIsa:
    return capped(_read_cpuinfo(), os.environ.get("ONEDNN_MAX_CPU_ISA"))


def dtype_warning(dtype: str) -> str | None:
    """Why a CPU dtype will run slowly on this machine, or None."""
    isa = detect()
    if dtype == "bfloat16" and not isa.native_bf16:
        return (
            f"--dtype bfloat16 on a CPU without native bfloat16 ({isa.summary()}): it is emulated and ran about "
            f"{EMULATED_BF16_SLOWDOWN}x slower than float32 on such a machine. Use --dtype float32 (what auto "
            "means on CPU), or --quantization int8 for a faster reduced-precision model"
        )
    if dtype == "float16" and not isa.native_fp16:
        return (
            f"--dtype float16 on a CPU without native float16 ({isa.summary()}): most of its matmuls fall back "
            "to slow reference kernels. Use --dtype float32 (what auto means on CPU)"
        )
    return None


# --- Constants tuned per ISA class (measured where docs/performance-history.md says; the rest inherit). ---

# Token budget of one CPU forward pass. Past it the activations spill out of cache and the time per token
# rises. 4096 was measured on an AVX-512-bf16 machine and on an AMX Xeon (MiniLM, float32: 7,028 tokens/s against
# 6,982 at 2048 and 5,927 at 8192; bfloat16: 19,447-19,917 against 16,666 at 2048 and 19,434 at 8192;
# docs/performance-history.md) and is kept for the other classes until benchmarks/cpu_efficiency.py's sweep on one
# of them says otherwise.
_CPU_BATCH_TOKENS = {"amx": 4096, "avx512_bf16": 4096, "avx512": 4096, "avx2": 4096, "baseline": 4096}

# bfloat16 attention on CPU: two batched matmuls beat SDPA's flash kernel from a run length on, and from a
# shorter length when the run holds enough tokens to pay the matmuls' fixed cost (about 40 us a call):
# (length, short length, tokens of a run of short sequences). Measured on an AVX-512-bf16 machine
# (docs/performance-history.md, issue 33: 4 x 57 tokens 186 us against the kernel's 329); where bf16 is emulated
# the matmuls are as slow as the kernel's own emulated math, so the flash kernel (less memory) stays. On an AMX
# Xeon the flash kernel won end to end (issue 56: MiniLM 15,109 tokens/s against 12,527 with these matmuls,
# bge-base 3,493 against 3,286; interleaved), so it keeps the flash kernel too.
_BF16_MATMUL_ATTENTION = {"avx512_bf16": (64, 32, 128)}
_NEVER = 1 << 30


# What runs around int8 linears (norms, attention, the dequantized outputs) with --quantization int8 and
# --dtype auto: bfloat16 where it is native, as fast as bf16 models there; float32 elsewhere.
_INT8_ACTIVATIONS = {
    "amx": "bfloat16",
    "avx512_bf16": "bfloat16",
    "avx512": "float32",
    "avx2": "float32",
    "baseline": "float32",
}

# int8 (weight levels, activation levels) by whether the CPU has VNNI. Without it oneDNN multiplies the
# unsigned activations by the signed weights with vpmaddubsw, whose 16-bit sums of two products saturate past
# 32767 (255 * 127 * 2 does). Either operand on 7 bits keeps every product exact; measured on MiniLM under
# ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 EPYC (docs/performance-history.md, issue 56; 200 real texts, lowest /
# mean cosine to float32): 7-bit weights (63, 255) 0.9953 / 0.9975, 7-bit activations (127, 127)
# 0.9909 / 0.9972, 8-bit both (127, 255, saturating) 0.9128 / 0.9791. VNNI accumulates in 32 bits: 8 bits both.
_INT8_LEVELS = {True: (127, 255), False: (63, 255)}

# --cpu-fusion auto: int8's quantize and dequantize steps compiled by inductor into one C++ loop each
# (models/int8.py), on every class: they are memory-bound passes, whatever the vector width.
_FUSION = {
    "amx": "compiled",
    "avx512_bf16": "compiled",
    "avx512": "compiled",
    "avx2": "compiled",
    "baseline": "compiled",
}
FUSIONS = ("auto", "compiled", "eager")


# cpu_varlen (attention/backends/cpu_varlen.cpp) as the default attention on CPU: the largest head size it is chosen
# for, by dtype (absent: sdpa stays the default). Measured end to end on MiniLM's 32-wide heads, 2 threads
# (docs/performance-history.md, issue 56): on an AVX-512-bf16 EPYC 1.05-1.06x sdpa at float32 and 1.04-1.12x at
# bfloat16, and one layer's attention at bge-base's 64-wide heads 1.46x at float32 but 0.91x at bfloat16 (sdpa's
# native bf16 matmuls); on an AVX2-only EPYC 1.03-1.11x at float32 (four alternating pairs; 64-wide heads not
# measured there); on an AMX Xeon, end to end, interleaved, at 32-wide heads 1.07-1.11x sdpa at float32 and 1.08x
# sdpa's flash kernel at bfloat16, at bge-base's 64-wide heads 0.96x at float32 and 0.85x at bfloat16 (sdpa's flash
# kernel calls oneDNN's bf16 brgemm ukernel there, ONEDNN_VERBOSE shows). Not measured on the other classes, so
# sdpa stays their default.
_CPU_VARLEN_DEFAULT = {
    "amx": {"float32": 32, "bfloat16": 32},
    "avx512_bf16": {"float32": 128, "bfloat16": 32},
    "avx2": {"float32": 32},
}
# For a model that generates, its decodes decide, by dtype: on the AVX-512-bf16 class cpu_varlen's paged_decode read
# one layer's decodes 1.2-5.2x faster than sdpa's path at float32 and 4-15x at bfloat16 (64- and 128-wide heads),
# and SmolLM2-135M's shape generated 1.07-1.32x (8 streams) and 1.29-1.47x (32 streams) faster at bfloat16 (three
# runs), where its prompts alone would have kept sdpa; so there it is the default at every head size it runs. On an
# AVX2-only EPYC, float32, behind the server (benchmarks/generate_servers.py, 2-layer Llama, 4 heads of 64) it
# generated 1.17-1.22x sdpa at 32 streams and 1.27-1.31x at 128; under an AVX2 cap on the AVX-512 machine
# SmolLM2's shape had measured 0.88x at 32 streams, which the real AVX2 part did not bear out. On an AMX Xeon, the
# same benchmark against sdpa: 1.26-1.40x at 128 streams, 0.81-1.03x then 1.15-1.32x at 32 (two runs; the first
# disturbed: its host ms/step rose too); at bfloat16 (--dtype bfloat16) 1.44-1.45x at 32 streams, 3.8-4.1x at 128.
_CPU_VARLEN_GENERATES = {"amx": ("float32", "bfloat16"), "avx512_bf16": ("float32", "bfloat16"), "avx2": ("float32",)}


def cpu_varlen_default(dtype: str, head_size: int, generates: bool = False) -> bool:
    """Whether cpu_varlen is the default attention for `dtype` ("float32", "bfloat16") and `head_size` here, for a
    model that generates (`generates`) or one that only reads its prompts."""
    level = detect().level
    if generates:
        return dtype in _CPU_VARLEN_GENERATES.get(level, ())
    return head_size <= _CPU_VARLEN_DEFAULT.get(level, {}).get(dtype, 0)


def cpu_batch_tokens() -> int:
    return _CPU_BATCH_TOKENS[detect().level]


def bf16_matmul_attention(num_seqs: int, length: int) -> bool:
    """Whether a run of `num_seqs` sequences of `length` tokens attends through two matmuls in bfloat16."""
    long, short, tokens = _BF16_MATMUL_ATTENTION.get(detect().level, (_NEVER, _NEVER, _NEVER))
    return length >= long or (length >= short and num_seqs * length >= tokens)


def int8_levels() -> tuple[int, int]:
    """(weight levels, activation levels) of int8 linears: weights span [-w, w], activations [0, a]."""
    return _INT8_LEVELS[detect().vnni]


def int8_activation_dtype() -> str:
    return _INT8_ACTIVATIONS[detect().level]


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use ($CXX, else g++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def fusion(requested: str = "auto") -> tuple[str, str]:
    """(compiled or eager, why) for --cpu-fusion `requested`."""
    if requested not in FUSIONS:
        raise ValueError(f"--cpu-fusion must be one of {', '.join(FUSIONS)}, not {requested!r}")
    choice = _FUSION[detect().level] if requested == "auto" else requested
    if choice == "eager":
        return "eager", "--cpu-fusion eager" if requested == "eager" else f"the {detect().level} default"
    compiler = cxx_compiler()
    if compiler is None:
        return "eager", "no C++ compiler for inductor ($CXX, g++ or clang++ on PATH)"
    return "compiled", f"inductor with {compiler}"
