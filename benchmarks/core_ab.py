"""Before/after of the engine core between two checkouts, in one run: embed, rerank and generate.

    python benchmarks/core_ab.py BASE_TREE NEW_TREE [--rounds 3] [--streams 32] [--max-tokens 32]
        [--workloads embed,embed-fresh,grpc-embed,rerank,generate] [--dtype float32]

BASE_TREE is e.g. a `git worktree` of the base commit. Each measurement runs in a fresh process that imports
embedserv from one tree; the trees alternate, round after round, and the best of the rounds counts (this
machine drifts between runs). Workloads, all in-process engines on the CPU in float32 (or --dtype):
- embed: 1,000 real texts in calls of 32, bundled all-MiniLM-L6-v2 (texts/s); every pass the same texts,
  so every pass runs the same batch shapes;
- embed-fresh: the same, but each pass (warm-up included) other texts, as a server sees them: batch shapes
  a pass has not seen before;
- grpc-embed: embed-fresh through a gRPC server started from the tree (`embedserv serve`, its model in a
  worker process as users run it), 4 calls in flight;
- rerank: a random cross-encoder of ms-marco-MiniLM-L6-v2's shape, 10 queries x 100 documents, all calls
  at once (pairs/s);
- generate: a random Llama in SmolLM2-135M's shape, N concurrent greedy streams of --max-tokens tokens
  (output tokens/s, prefill included).
Prints a markdown table with the CPU's name and flags.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _types():
    try:
        import embedserv.types as types
    except ImportError:  # checkouts before the engine-core change
        import embedserv.engine.types as types
    return types


def grpc_child(tree: str, dtype: str) -> float:
    """texts/s of embed-fresh through a server running `tree`'s embedserv (this process is only the client)."""
    import asyncio

    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.corpus import stdlib_texts
    from benchmarks.embed_throughput import grpc_embed_calls
    from tests.helpers.server import running_server

    best = 0.0
    with running_server(["--dtype", dtype], cwd=Path(tree)) as (target, _):
        for seed in range(3):  # the first pass warms up
            texts = stdlib_texts(1000, seed=seed)
            start = time.perf_counter()
            asyncio.run(grpc_embed_calls(target, [texts[i : i + 32] for i in range(0, len(texts), 32)], 4))
            if seed:
                best = max(best, len(texts) / (time.perf_counter() - start))
    return best


def child(tree: str, workload: str, model: str, streams: int, max_tokens: int, dtype: str) -> float:
    if workload == "grpc-embed":
        return grpc_child(tree, dtype)
    sys.path.insert(0, tree)
    sys.path.insert(1, str(REPO_ROOT))
    import embedserv

    if not embedserv.__file__.startswith(tree):
        raise SystemExit(f"imported embedserv from {embedserv.__file__}, not from {tree}")
    from benchmarks.corpus import stdlib_texts
    from embedserv.config import ModelConfig, bundled_model_path
    from embedserv.engine.sync import SyncEngine

    types = _types()
    path = model or str(bundled_model_path())
    config = ModelConfig(
        path=path, served_name="m", kv_cache_memory=2**30 if workload == "generate" else None, dtype=dtype
    )
    with SyncEngine(config) as engine:
        if workload.startswith("embed"):
            seeds = itertools.count() if workload == "embed-fresh" else itertools.repeat(0)

            def run() -> int:
                texts = stdlib_texts(1000, seed=next(seeds))
                calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
                engine.embed_concurrently(calls, types.EmbedParams(truncate=True))
                return len(texts)
        elif workload == "rerank":
            queries = [" ".join(t.split()[:8]) for t in stdlib_texts(10, seed=21)]
            documents = stdlib_texts(100, seed=22)

            def run() -> int:
                engine.rerank_concurrently([(q, documents) for q in queries], types.RerankParams(truncate=True))
                return len(queries) * len(documents)
        else:
            texts = [" ".join(t.split()[: 30 + (i * 7) % 60]) for i, t in enumerate(stdlib_texts(streams, seed=31))]
            params = [types.SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * streams

            def run() -> int:
                results = engine.generate_concurrently(texts, params)
                return sum(len(d.token_ids) for r in results for d in r)

        run()
        best = 0.0
        for _ in range(2):
            start = time.perf_counter()
            done = run()
            best = max(best, done / (time.perf_counter() - start))
    return best


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni") if f in flags]
    return f"{name or platform.processor()} ({', '.join(isa)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workloads", default="embed,rerank,generate")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--child", nargs=2, metavar=("TREE", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.model, args.streams, args.max_tokens, args.dtype)))
        return
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.generate_throughput import build_model
    from benchmarks.rerank_throughput import build_minilm_cross_encoder

    workloads = args.workloads.split(",")
    best = {(w, t): 0.0 for w in workloads for t in ("base", "new")}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"embed": "", "embed-fresh": "", "grpc-embed": "",
                  "rerank": str(build_minilm_cross_encoder(Path(tmp) / "ce")),
                  "generate": str(build_model(Path(tmp) / "llama"))}  # fmt: skip
        for _ in range(args.rounds):
            for workload in workloads:
                for label, tree in (("base", args.base), ("new", args.new)):
                    out = subprocess.run(
                        [sys.executable, __file__, args.base, args.new, "--child", str(Path(tree).resolve()), workload,
                         "--model", models[workload], "--streams", str(args.streams),
                         "--max-tokens", str(args.max_tokens), "--dtype", args.dtype],
                        check=True, capture_output=True, text=True,
                    )  # fmt: skip
                    value = json.loads(out.stdout.strip().splitlines()[-1])
                    best[workload, label] = max(best[workload, label], value)
    units = {
        "embed": "texts/s",
        "embed-fresh": "texts/s",
        "grpc-embed": "texts/s",
        "rerank": "pairs/s",
        "generate": f"tokens/s at {args.streams} streams",
    }
    print(f"CPU: {cpu_name()}; best of {args.rounds} alternating rounds, {args.dtype}\n")
    print("| workload | base | new | new / base |\n|---|---|---|---|")
    for workload in workloads:
        base, new = best[workload, "base"], best[workload, "new"]
        print(f"| {workload} ({units[workload]}) | {base:.1f} | {new:.1f} | {new / base:.2f}x |")


if __name__ == "__main__":
    main()
