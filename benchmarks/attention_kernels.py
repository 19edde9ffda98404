"""Attention kernels on the shapes a small encoder sees: where each CPU path wins.

    python benchmarks/attention_kernels.py [--heads 12] [--head-size 32] [--repeats 20]

Times, per dtype and (sequences, length): torch's SDPA (the flash kernel on CPU), the same attention as
two batched matmuls, and our sdpa backend on a packed batch. The bf16 matmul-attention switch in
embedserv/cpu_isa.py (per ISA class) comes from this table. Prints markdown.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.nn.functional as F

from embedserv.attention.backends.sdpa import SdpaBackend, _attend_with_matmuls
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for

SHAPES = [(1, 32), (1, 64), (1, 128), (1, 256), (16, 64), (16, 128), (16, 256)]


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def packed_backend_us(num_seqs: int, length: int, heads: int, head_size: int, dtype, repeats: int) -> float:
    tokens = num_seqs * length
    q, k, v = (torch.randn(tokens, heads * head_size, dtype=dtype) for _ in range(3))
    layer = Attention(heads, head_size)
    backend = SdpaBackend()
    meta = backend.build_metadata(build_common_metadata(np.full(num_seqs, length), is_causal=False))
    context = forward_context_for([layer], backend, meta)

    def run():
        with set_forward_context(context):
            layer(q, k, v)

    return best_us(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads}, "
        f"head size {args.head_size}, best of {args.repeats}"
    )
    print("| dtype | seqs x length | SDPA (flash) us | two matmuls us | sdpa backend us | faster |")
    print("|---|---|---:|---:|---:|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for num_seqs, length in SHAPES:
                shape = (num_seqs, args.heads, length, args.head_size)
                q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
                scale = args.head_size**-0.5
                flash = best_us(functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scale), args.repeats)
                matmul = best_us(functools.partial(_attend_with_matmuls, q, k, v, scale, False), args.repeats)
                ours = packed_backend_us(num_seqs, length, args.heads, args.head_size, dtype, args.repeats)
                winner = "matmuls" if matmul < flash else "flash"
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {num_seqs} x {length} | {flash:.0f} | {matmul:.0f} "
                    f"| {ours:.0f} | {winner} |"
                )


if __name__ == "__main__":
    main()
