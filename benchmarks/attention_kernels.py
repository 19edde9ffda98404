"""Attention kernels on the shapes a small encoder sees: where each CPU path wins.

    python benchmarks/attention_kernels.py [--heads 12] [--head-size 32] [--repeats 20]
    python benchmarks/attention_kernels.py --packed [--threads 2] [--save benchmarks/results/FILE.md]

Times, per dtype and (sequences, length): torch's SDPA (the flash kernel on CPU), the same attention as
two batched matmuls, and our sdpa backend on a packed batch. The bf16 matmul-attention switch in
embedserv/cpu_isa.py (per ISA class) comes from this table. Prints markdown.

--packed: one attention layer over packed batches, the sdpa backend (today's CPU path) against the
cpu_varlen C++ kernel (attention/backends/cpu_varlen.py), on MiniLM's heads (12 x 32) and bge-base's (12 x 64),
float32 and bfloat16: equal lengths from 16 to 512 tokens, and batches as the server builds them (real texts
from benchmarks/corpus.py tokenized by the bundled MiniLM tokenizer, truncated at the model's limit, packed
longest first up to the CPU batch budget). The two run alternately, best of --repeats each, and the selector's
choice of cpu_varlen (attention/selector.py) comes from this table.
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

from embedserv import cpu_isa
from embedserv.attention.backends.cpu_varlen import CpuVarlenBackend
from embedserv.attention.backends.sdpa import SdpaBackend, _attend_with_matmuls
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for

SHAPES = [(1, 32), (1, 64), (1, 128), (1, 256), (16, 64), (16, 128), (16, 256)]


# --cpu-time: one thread's CPU time instead of wall time (a shared machine's other load counts less).
CLOCK = {"now": time.perf_counter}


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = CLOCK["now"]()
        fn()
        best = min(best, CLOCK["now"]() - start)
    return best * 1e6


def layer_call(backend, lens, heads: int, head_size: int, dtype, causal: bool = False):
    """One attention layer over a packed batch of `lens`, q, k and v slices of one fused projection as the
    models pass them; the metadata is built once, as a step builds it for every layer."""
    tokens = int(sum(lens))
    q, k, v = torch.randn(tokens, 3 * heads * head_size, dtype=dtype).split(heads * head_size, dim=1)
    layer = Attention(heads, head_size)
    meta = backend.build_metadata(build_common_metadata(np.asarray(lens), is_causal=causal))
    context = forward_context_for([layer], backend, meta)

    def run():
        with set_forward_context(context):
            layer(q, k, v)

    return run


def packed_backend_us(num_seqs: int, length: int, heads: int, head_size: int, dtype, repeats: int) -> float:
    return best_us(layer_call(SdpaBackend(), [length] * num_seqs, heads, head_size, dtype), repeats)


def server_batches(limit: int, budget: int) -> list[int]:
    """The first batch the server would build from the corpus: token counts (special tokens included) of
    real texts truncated at `limit`, as many as fit `budget` tokens, longest first."""
    from tokenizers import Tokenizer

    from benchmarks.corpus import stdlib_texts
    from embedserv.config import bundled_model_path

    tokenizer = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    lens, total = [], 0
    for text in stdlib_texts(512, seed=0):
        n = min(len(tokenizer.encode(text).ids), limit)
        if total + n > budget:
            break
        lens.append(n)
        total += n
    return sorted(lens, reverse=True)


def packed_rows(heads: int, head_size: int, limit: int, repeats: int):
    """(dtype, mix, tokens, sdpa us, cpu_varlen us) for one head shape."""
    mixes = {f"{n} x {length}": [length] * n for n, length in ((64, 16), (32, 64), (32, 128), (16, 256), (8, 512))}
    mixes[f"server batch (corpus, <= {limit})"] = server_batches(limit, cpu_isa.cpu_batch_tokens())
    for dtype in (torch.float32, torch.bfloat16):
        for mix, lens in mixes.items():
            sdpa = layer_call(SdpaBackend(), lens, heads, head_size, dtype)
            ours = layer_call(CpuVarlenBackend(), lens, heads, head_size, dtype)
            best = {"sdpa": float("inf"), "cpu_varlen": float("inf")}
            # Alternating rounds: this machine drifts, and the two should see the same drift.
            for _ in range(max(1, repeats // 4)):
                best["sdpa"] = min(best["sdpa"], best_us(sdpa, 4))
                best["cpu_varlen"] = min(best["cpu_varlen"], best_us(ours, 4))
            yield dtype, mix, sum(lens), best["sdpa"], best["cpu_varlen"]


def packed_table(args) -> list[str]:
    lines = [
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_isa.detect().summary()}, "
        f"one layer's attention, best of {args.repeats} (alternating), us of "
        f"{'one thread CPU time' if args.cpu_time else 'wall time'}",
        "| model heads | dtype | batch | tokens | sdpa (today) | cpu_varlen | speed-up |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for label, head_size, limit in (("MiniLM 12 x 32", 32, 256), ("bge-base 12 x 64", 64, 512)):
        for dtype, mix, tokens, sdpa, ours in packed_rows(12, head_size, limit, args.repeats):
            line = (
                f"| {label} | {str(dtype).removeprefix('torch.')} | {mix} | {tokens} | {sdpa:.0f} | {ours:.0f} "
                f"| {sdpa / ours:.2f}x |"
            )
            print(line, flush=True)
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--packed", action="store_true", help="sdpa against cpu_varlen on packed batches")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--save", type=Path, default=None, help="--packed: also append the table here")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads, CLOCK["now"] = 1, time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.packed:
        with torch.inference_mode():
            lines = packed_table(args)
        if args.save:
            with args.save.open("a") as file:
                file.write("\n".join(lines) + "\n\n")
        return
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
