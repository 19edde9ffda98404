"""One layer's decode attention over the paged cache on CPU: sdpa's gathered path against cpu_varlen's paged_decode.

    python benchmarks/paged_decode.py [--repeats 30] [--dtype float32|bfloat16]

Per shape (decodes, query / KV heads, head size, keys per decode drawn uniformly from a range): the float32 path
the sdpa backend takes (attention/backends/paged_decode.py: every key of the step gathered by whole blocks, one
batched matmul, values summed by embedding_bag; in bfloat16, keys and values gathered, then two float32 matmuls)
against the C++ op (cpu_paged_decode.cpp: keys and values read in
place through the block tables), over a 16,384-block cache with shuffled tables, best of --repeats each; the
largest difference between the two is printed beside them. Prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.attention_kernels import best_us
from embedserv import cpu_isa
from embedserv.attention.backends.base import gather_blocks
from embedserv.attention.backends.cpu_varlen_kernel import paged_decode_op
from embedserv.attention.backends.paged_decode import decode_gathered, decode_with_matmuls, value_rows

BLOCK_SIZE, BLOCKS = 16, 16384
# (decodes, query heads, KV heads, head size, fewest keys, most keys)
SHAPES = [
    (128, 4, 4, 64, 60, 350),  # benchmarks/generate_servers.py's model at 128 streams
    (32, 9, 3, 64, 60, 250),  # SmolLM2-135M's heads (benchmarks/generate_throughput.py) at 32 streams
    (8, 9, 3, 64, 60, 250),
    (32, 16, 16, 64, 100, 500),
    (32, 12, 2, 128, 100, 500),
]


def row(op, dtype, n: int, heads: int, kv_heads: int, size: int, fewest: int, most: int, repeats: int) -> str:
    rng = np.random.default_rng(0)
    cache = (torch.randn(2, BLOCKS, BLOCK_SIZE, kv_heads, size) * 0.1).to(dtype)
    lens = rng.integers(fewest, most, n)
    blocks = -(-int(lens.max()) // BLOCK_SIZE)
    tables = torch.from_numpy(rng.permutation(BLOCKS)[: n * blocks].reshape(n, blocks)).to(torch.int32)
    q, scale, positions = torch.randn(n, heads, size).to(dtype), size**-0.5, torch.from_numpy(lens - 1)
    mask = (torch.arange(blocks * BLOCK_SIZE)[None, :] < torch.from_numpy(lens)[:, None])[:, None, None, :]
    rows = value_rows(tables, BLOCK_SIZE, heads, kv_heads)

    def gathered() -> torch.Tensor:
        if dtype == torch.bfloat16:
            return decode_with_matmuls(q, *gather_blocks(cache, tables), mask, scale)
        return decode_gathered(q, cache, tables, rows, mask, scale)

    def kernel() -> torch.Tensor:
        return op(q, cache, tables, positions, 0, scale)

    slow, fast = best_us(gathered, repeats), best_us(kernel, repeats)
    diff = (gathered().float() - kernel().float()).abs().max().item()
    shape = f"| {n} | {heads} / {kv_heads} | {size} | {fewest}-{most} "
    return shape + f"| {slow:.0f} | {fast:.0f} | {slow / fast:.2f}x | {diff:.1e} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    op = paged_decode_op()
    if op is None:
        sys.exit("cpu_varlen's library cannot be built here (no C++ compiler)")
    threads = torch.get_num_threads()
    print(f"# {cpu_isa.detect().summary()}; torch {torch.__version__}, {threads} threads; {args.dtype}\n")
    print("| decodes | heads / KV heads | head size | keys | gathered, us | paged_decode, us | speed-up | max diff |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for shape in SHAPES:
        print(row(op, dtype, *shape, args.repeats))


if __name__ == "__main__":
    main()
