"""What every peer runner shares: the job file, the timing rule, the result files, and the CPU probe.

Runners run under the peers' own interpreters, so this module imports only the standard library and numpy.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ISA flags the benchmark header names, in this order.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")


def read_job() -> dict[str, Any]:
    """The job the driver wrote: `python -m benchmarks.peer_runners.NAME JOB.json`."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {sys.argv[0]} JOB.json (written by benchmarks/peers.py)")
    return json.loads(Path(sys.argv[1]).read_text())


def read_texts(job: dict[str, Any], key: str = "texts") -> list[str]:
    return json.loads(Path(job[key]).read_text())


def chunked(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def best_of(repeats: int, run: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of `repeats` timed calls of run() (the machine drifts from pass to pass), and the last
    call's result. The caller warms up first."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def warm_then_best_of(job: dict, encode: Callable[[list[str]], Any], texts: list[str]) -> tuple[float, Any]:
    """One untimed encode of the job's warm-up texts, then best_of its repeats over all texts."""
    encode(texts[: job["warmup_texts"]])
    return best_of(job["repeats"], lambda: encode(texts))


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def write_result(job: dict[str, Any], vectors, **fields: Any) -> None:
    """vectors (one float32 row per text, in the texts' order) to job["vectors"]; fields to job["result"]."""
    import numpy as np

    array = np.asarray(vectors, dtype=np.float32)
    if array.ndim != 2 or len(array) != len(read_texts(job)):
        raise ValueError(f"expected one vector per text, got an array of shape {array.shape}")
    np.save(job["vectors"], array)
    Path(job["result"]).write_text(json.dumps(fields, indent=2))


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of the named distributions; missing ones are left out."""
    found = {}
    for name in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """The CPU's model name and its flags ("" and no flags where /proc/cpuinfo is unreadable)."""
    name, flags = "", frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return name, flags
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


def ort_int8_config(flags: frozenset[str]) -> str | None:
    """The sentence-transformers / ONNX Runtime dynamic int8 config that matches the CPU, or None without AVX2."""
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else None
