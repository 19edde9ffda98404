"""Builds and loads the C++ attention kernels (cpu_varlen.cpp, cpu_paged_decode.cpp) once per machine.

At first use the sources are compiled into one library for this CPU's class (at::vec's CPU_CAPABILITY: AVX512,
AVX2 or DEFAULT) with the C++ compiler on PATH, against the installed torch's headers, into a cache directory
($EMBEDSERV_KERNEL_CACHE, else ~/.cache/embedserv/kernels) under a name keyed by the sources (the shared header
too), the flags and the torch version: later processes load the library without compiling. The two sources
compile at once (two cores where there are). A build is written to a temporary name and renamed, so no process
reads a half-written file, and under a file lock, so processes that start at once (data-parallel workers, test
workers) build it once: the others wait and load it. Where no compiler is present or the build fails,
`attention_op()` and `paged_decode_op()` return None and the first logs why once: the backend then runs today's
sdpa path (attention/backends/cpu_varlen.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from embedserv import cpu_isa

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_varlen.cpp")
# The library's other files: its second op, and the header both sources include.
_PAGED_DECODE = Path(__file__).with_name("cpu_paged_decode.cpp")
_HEADER = Path(__file__).with_name("cpu_kernels.h")
# Seconds one build may take (a few on a free machine; two busy cores can take a minute).
_BUILD_TIMEOUT = 600
# torch's own kernels are built with these per class (cmake/Codegen.cmake); at::vec reads the macros.
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2", "-mf16c")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")

_lock = threading.Lock()
_loaded: dict[str, Callable | None] = {}


def compiler() -> str | None:
    """The C++ compiler on PATH, if any ($CXX first)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def capability() -> tuple[str, tuple[str, ...]]:
    """at::vec's CPU_CAPABILITY for this CPU and the compiler flags it needs."""
    isa = cpu_isa.detect()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= isa.flags:
        return "AVX512", _AVX512_FLAGS
    if {"avx2", "fma"} <= isa.flags:
        return "AVX2", _AVX2_FLAGS
    return "DEFAULT", ()


def cache_dir() -> Path:
    configured = os.environ.get("EMBEDSERV_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "embedserv" / "kernels"


def compile_flags() -> list[str]:
    """Flags of every object of the library: this CPU class's, OpenMP's, torch's headers and ABI."""
    from torch.utils.cpp_extension import include_paths

    level, flags = capability()
    defines = [f"-DCPU_CAPABILITY={level}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    if level != "DEFAULT":
        defines.append(f"-DCPU_CAPABILITY_{level}")
    return [
        "-O3",
        # ATen's parallel_for runs its body on the calling thread alone unless the including source is built with
        # OpenMP; libgomp.so.1 then resolves to the one torch has loaded already.
        "-fopenmp",
        "-std=c++17",
        "-fPIC",
        *flags,
        *defines,
        f"-I{_HEADER.parent}",
        *(f"-I{path}" for path in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
    ]


def link_command(cxx: str, objects: list[Path], output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).parent / "lib"
    return [cxx, "-shared", "-fopenmp", *map(str, objects), "-o", str(output), f"-L{torch_lib}", "-lc10",
            "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]  # fmt: skip


def library_path(cxx: str) -> Path:
    """Where these sources, built with these flags for this torch, live in the cache."""
    key = hashlib.sha256(b"".join(path.read_bytes() for path in (SOURCE, _PAGED_DECODE, _HEADER)))
    key.update(" ".join([cxx, *compile_flags(), *link_command(cxx, [], Path("out"))]).encode())
    key.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return cache_dir() / f"cpu_varlen-{key.hexdigest()[:16]}.so"


def _run(commands: list[list[str]], cxx: str, scratch: Path) -> None:
    """Runs `commands` at once (each source compiles on a core of its own); the first failure stops the others
    and raises with its error."""
    logs = [scratch / f"command-{i}.log" for i in range(len(commands))]
    running: list[subprocess.Popen] = []
    deadline = time.monotonic() + _BUILD_TIMEOUT
    try:
        for command, log in zip(commands, logs, strict=True):
            with open(log, "wb") as out:
                running.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out))
        while (codes := [proc.poll() for proc in running]).count(None) and not any(codes):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(commands[codes.index(None)], _BUILD_TIMEOUT)
            time.sleep(0.05)
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for code, log in zip(codes, logs, strict=True):
        if code:
            error = log.read_text(errors="replace").strip().splitlines() or [""]
            raise RuntimeError(f"{Path(cxx).name} failed: {error[-1][:300]}")


def _build(cxx: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        sources = (SOURCE, _PAGED_DECODE)
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        flags = compile_flags()
        _run([[cxx, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources, objects, strict=True)],
             cxx, Path(scratch))  # fmt: skip
        partial = Path(scratch) / path.name
        _run([link_command(cxx, objects, partial)], cxx, Path(scratch))
        os.replace(partial, path)


def _load() -> Callable | None:
    cxx = compiler()
    if cxx is None:
        logger.warning("cpu_varlen attention: compiled kernel unavailable (no C++ compiler on PATH); running sdpa")
        return None
    try:
        path = library_path(cxx)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process's build of the same file: wait for it
                if not path.exists():
                    logger.info("cpu_varlen attention: compiling %s for %s into %s", SOURCE.name, capability()[0], path)
                    _build(cxx, path)
        torch.ops.load_library(str(path))
        return torch.ops.embedserv_cpu_varlen.attention
    except Exception as exc:
        logger.warning(
            "cpu_varlen attention: compiled kernel unavailable (%s: %s); running sdpa", type(exc).__name__, exc
        )
        return None


def attention_op() -> Callable | None:
    """torch.ops.embedserv_cpu_varlen.attention, built and loaded on first call; None where it cannot be.

    attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale) -> out: q [num_q, heads, d], k and v
    [num_k, kv_heads, d] (the last dim contiguous), float32 or bfloat16; window 0 for none."""
    with _lock:
        if "op" not in _loaded:
            _loaded["op"] = _load()
        return _loaded["op"]


def paged_decode_op() -> Callable | None:
    """torch.ops.embedserv_cpu_varlen.paged_decode from the same library; None where it cannot be built.

    paged_decode(q, kv_cache, block_tables, positions, window, scale) -> out: q [n, heads, d], one query per
    sequence at `positions` [n], over kv_cache [2, blocks, block_size, kv_heads, d] through block_tables [n, m]
    (int32 or int64), of q's dtype (float32 or bfloat16); the query sees keys 0..position (the last `window`
    of them; 0 for all)."""
    return None if attention_op() is None else torch.ops.embedserv_cpu_varlen.paged_decode
