"""What one CPU linear does to a process's memory when its row count changes every call (issue 30).

Each case runs in a fresh interpreter: 3,000 calls of MiniLM's intermediate linear (384 -> 1536, the
oneDNN-packed weight and fused GELU a CPU worker runs) on a random number of rows from 1 to 4,096, either
as drawn or padded to `embedserv.models.layers.padded_rows`. After every 1,000 calls it prints glibc's view of the
heap (`mallinfo2`: bytes in use, bytes free but kept) and the resident set. oneDNN's primitive cache and
ideep's LRU of them are keyed by shape; a case can shrink them through the environment.

    python benchmarks/shape_memory.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# (label, rows, environment)
CASES = [
    ("random rows, default caches", "random", {}),
    ("random rows, ONEDNN_PRIMITIVE_CACHE_CAPACITY=0", "random", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}),
    (
        "random rows, oneDNN cache 0 and LRU_CACHE_CAPACITY=16",
        "random",
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "16"},
    ),
    ("rows padded (models/layers.padded_rows)", "padded", {}),
]

_CHILD = """
import ctypes, random, sys
import torch
from embedserv.models.layers import padded_rows

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def report(calls):
    info = libc.mallinfo2()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * 4096
    print(calls, info.uordblks / 2**20, info.fordblks / 2**20, rss / 2**20, flush=True)

torch.set_num_threads(2)
rows_kind, calls = sys.argv[1], int(sys.argv[2])
weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 384))
bias = torch.randn(1536)
draw = random.Random(0)
with torch.inference_mode():
    report(0)
    for call in range(1, calls + 1):
        rows = draw.randrange(1, 4097)
        if rows_kind == "padded":
            rows = padded_rows(rows)
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 384), weight, bias, "gelu", [], "none")
        if call % 1000 == 0:
            report(call)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    print("| case | calls | in use MiB | free but kept MiB | RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    for label, rows, env in CASES:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, rows, str(args.calls)],
            cwd=root,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        for line in out.stdout.split("\n"):
            if line.strip():
                calls, in_use, free, rss = line.split()
                print(f"| {label} | {calls} | {float(in_use):.0f} | {float(free):.0f} | {float(rss):.0f} |", flush=True)


if __name__ == "__main__":
    main()
