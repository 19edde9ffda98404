"""CPU attention routes end to end: one engine per route in this process, passes interleaved, best of --repeats.

    python benchmarks/attention_routes.py [--model DIR] [--dtype bfloat16|float32] [--texts 1000] [--repeats 4]
        [--routes today,flash,matmuls,cpu_varlen]

Routes: `today` is sdpa with this CPU class's bfloat16 matmul thresholds (cpu_isa.bf16_matmul_attention);
`flash` is sdpa with SDPA's flash kernel for every run; `matmuls` is sdpa with two batched matmuls for every run;
`cpu_varlen` is attention/backends/cpu_varlen.cpp. At float32 the first three are one route (the thresholds are
for bfloat16 only): ask for `today,cpu_varlen`. Each engine embeds the same real texts (benchmarks/corpus.py),
32 per call; the rounds take the routes in turn, so load from others on the machine hits every route alike.
This is how cpu_isa's attention constants were chosen per CPU class; prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Each engine's model thread has its own OpenMP team: spinning, an idle team would take the cores from the next.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.corpus import stdlib_texts
from embedserv import cpu_isa
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams

NEVER = (cpu_isa._NEVER,) * 3
# route -> (attention backend, bfloat16 matmul thresholds; None: the class's own)
ROUTES = {
    "today": ("sdpa", None),
    "flash": ("sdpa", NEVER),
    "matmuls": ("sdpa", (0, 0, 0)),
    "cpu_varlen": ("cpu_varlen", None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(bundled_model_path()))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--routes", default=",".join(ROUTES))
    args = parser.parse_args()
    routes = args.routes.split(",")
    level = cpu_isa.detect().level
    own = cpu_isa._BF16_MATMUL_ATTENTION.get(level, NEVER)
    texts = stdlib_texts(args.texts)
    calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
    params = EmbedParams(truncate=True)

    engines = {}
    for route in routes:
        backend = ROUTES[route][0]
        engines[route] = SyncEngine(ModelConfig(path=args.model, served_name="bench", dtype=args.dtype,
                                                attention_backend=backend)).__enter__()  # fmt: skip
    best, tokens = dict.fromkeys(routes, float("inf")), 0
    # The thresholds each route runs under, restored as they were afterwards.
    with mock.patch.dict(cpu_isa._BF16_MATMUL_ATTENTION):
        try:
            for round_ in range(args.repeats + 1):  # round 0 warms every route's shapes up
                for route in routes:
                    cpu_isa._BF16_MATMUL_ATTENTION[level] = ROUTES[route][1] or own
                    start = time.perf_counter()
                    results = engines[route].embed_concurrently(calls, params)
                    if round_:
                        best[route] = min(best[route], time.perf_counter() - start)
                    tokens = sum(r.prompt_tokens for r in results)
        finally:
            for engine in engines.values():
                engine.__exit__(None, None, None)

    print(f"# {cpu_isa.detect().summary()}; {args.model}; {args.dtype}; {len(texts)} texts, {tokens} tokens; "
          f"best of {args.repeats} interleaved rounds after one warm-up round")  # fmt: skip
    print(f"\n| route | tokens/s | vs {routes[0]} |\n|---|---:|---:|")
    for route in routes:
        print(f"| {route} | {tokens / best[route]:,.0f} | {best[routes[0]] / best[route]:.2f}x |")


if __name__ == "__main__":
    main()
