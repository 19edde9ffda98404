"""Precisions and CPU kernel paths against each other, interleaved: the in-process engine's tokens/s.

    python benchmarks/precisions.py [--model DIR] [--texts 600] [--rounds 3]
        [--precisions float32,bfloat16,int8:float32:eager,int8:float32,int8]

A precision is `float32`, `bfloat16`, or `int8[:ACTIVATIONS[:FUSION[:W/A]]]` (activations float32, bfloat16 or
auto; fusion auto, compiled or eager, as --dtype and --cpu-fusion take them; W/A the weight and activation
levels instead of cpu_isa's choice, e.g. 127/255 or 63/255). Each round starts every
precision's engine afresh, runs one untimed pass and one timed pass over the same real texts (calls of 32,
all in flight), and stops it; the best round counts. Interleaving rounds is what makes the ratios hold on a
machine that drifts by 5-20% between runs (docs/performance-history.md). Prints a markdown table with the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.corpus import stdlib_texts
from embedserv import cpu_isa
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams
from embedserv.worker.allocator import keep_step_memory


def options(precision: str) -> dict[str, str]:
    """`int8:bfloat16:eager` -> ModelConfig keyword arguments."""
    kind, _, rest = precision.partition(":")
    if kind != "int8":
        return {"dtype": kind}
    dtype, _, rest = rest.partition(":")
    fusion = rest.partition(":")[0]
    return {"quantization": "int8", "dtype": dtype or "auto", "cpu_fusion": fusion or "auto"}


def int8_levels(precision: str) -> tuple[int, int] | None:
    """`int8:float32:auto:63/255` -> (63, 255); None where cpu_isa chooses."""
    levels = precision.split(":")[3:]
    if not levels:
        return None
    weights, _, activations = levels[0].partition("/")
    return int(weights), int(activations)


def one_round(model: str, precision: str, calls: list[list[str]]) -> tuple[float, int]:
    params = EmbedParams(truncate=True)
    forced, chosen = int8_levels(precision), cpu_isa.int8_levels
    if forced is not None:
        cpu_isa.int8_levels = lambda: forced  # read once, when the replica quantizes its linears
    try:
        with SyncEngine(ModelConfig(path=model, served_name="bench", **options(precision))) as engine:
            engine.embed_concurrently(calls, params)
            start = time.perf_counter()
            tokens = sum(r.prompt_tokens for r in engine.embed_concurrently(calls, params))
            return time.perf_counter() - start, tokens
    finally:
        cpu_isa.int8_levels = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(bundled_model_path()))
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", default="float32,bfloat16,int8:float32:eager,int8:float32,int8")
    args = parser.parse_args()
    keep_step_memory()  # the glibc settings a server's worker process makes for itself
    texts = stdlib_texts(args.texts)
    calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
    precisions = args.precisions.split(",")
    best = {p: 0.0 for p in precisions}
    for _ in range(args.rounds):
        for precision in precisions:
            seconds, tokens = one_round(args.model, precision, calls)
            best[precision] = max(best[precision], tokens / seconds)
    print(
        f"# {cpu_isa.detect().summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{Path(args.model).name}, {len(texts)} texts ({tokens} tokens), best of {args.rounds} interleaved rounds"
    )
    print("\n| precision | tokens/s | vs first |")
    print("|---|---:|---:|")
    for precision in precisions:
        print(f"| {precision} | {best[precision]:.0f} | {best[precision] / best[precisions[0]]:.2f}x |")


if __name__ == "__main__":
    main()
