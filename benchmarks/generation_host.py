"""The engine's host work per generation step, piece by piece, with no worker: CPU milliseconds per step.

    python benchmarks/generation_host.py [--streams 32,128] [--steps 64] [--repeats 5] [--base DIR]

N requests (prompts of 40 to 120 tokens, random ids, the bundled tokenizer's vocabulary) run together for
--steps steps, as the engine process runs them between two of the worker's steps:
- schedule: GenerationScheduler.schedule (the step's sequences, their block tables);
- encode: the step as a delta (executor/step_delta.py) and its frames (executor/codec.py);
- update: the sampled tokens back into the scheduler;
- detokenize: each stream's IncrementalDetokenizer.add, with the bundled WordPiece tokenizer (the generation
  benchmarks' tokenizer); the sampled tokens are the prompt's own, so the text is real words.
What the server's loop adds (waking each caller, the protocol) is not here: benchmarks/generate_servers.py has
the whole engine process's CPU per step. Each piece is timed in process CPU time (time.process_time), first
step left out, best of --repeats. `--base DIR`: the same in a worktree of another commit, in its own process,
a row per checkout. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def measure(streams: int, steps: int, repeats: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from embedserv.config import bundled_model_path
    from embedserv.engine.core.detokenizer import IncrementalDetokenizer
    from embedserv.executor.messages import CODEC, RunGenerationStep
    from embedserv.executor.step_delta import DeltaEncoder
    from embedserv.scheduler.generation import GenerationScheduler
    from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
    from embedserv.scheduler.request import Request
    from embedserv.steps import OutputKind
    from embedserv.types import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    rng = random.Random(0)
    vocabulary = range(1000, len(tokenizer))
    prompts = [[rng.choice(vocabulary) for _ in range(40 + (i * 7) % 80)] for i in range(streams)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)

    def one_pass() -> dict[str, float]:
        kv_cache = KvCacheManager([KvGroup(16)], 64 * streams, enable_prefix_caching=True)
        scheduler = GenerationScheduler(kv_cache, max_batch_tokens=16384, max_num_seqs=max(256, streams))
        for request_id, prompt in enumerate(prompts):
            scheduler.add(Request(request_id, list(prompt), OutputKind.SAMPLE, params))
        detokenizers = [IncrementalDetokenizer(tokenizer, prompt) for prompt in prompts]
        encoder = DeltaEncoder()
        spent = dict.fromkeys(("schedule", "encode", "update", "detokenize"), 0.0)
        for step in range(steps):
            t0 = time.process_time()
            batch = scheduler.schedule()
            t1 = time.process_time()
            CODEC.encode(RunGenerationStep(step, encoder.encode(batch)))
            t2 = time.process_time()
            sampled = {s.request_id: prompts[s.request_id][step % 40] for s in batch.sequences if s.produces_output}
            scheduler.update(batch, sampled)
            t3 = time.process_time()
            for request_id, token in sampled.items():
                detokenizers[request_id].add(token)
            t4 = time.process_time()
            if step:  # the first step is the prompts' prefill
                for piece, seconds in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    spent[piece] += seconds
        return {piece: seconds / (steps - 1) * 1e3 for piece, seconds in spent.items()}

    passes = [one_pass() for _ in range(repeats)]
    return {piece: min(p[piece] for p in passes) for piece in passes[0]}


def run_checkout(checkout: Path, streams: list[int], steps: int, repeats: int) -> dict[int, dict[str, float]]:
    """This benchmark's measure() in a process that imports embedserv from `checkout`."""
    code = (
        "import json, runpy, sys; sys.path.insert(0, sys.argv[2]);"
        "measure = runpy.run_path(sys.argv[1])['measure'];"
        "print(json.dumps({n: measure(int(n), int(sys.argv[4]), int(sys.argv[5])) for n in sys.argv[3].split(',')}))"
    )
    args = [__file__, str(checkout), ",".join(map(str, streams)), str(steps), str(repeats)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"the run in {checkout} failed:\n{out.stderr[-3000:]}")
    return {int(n): r for n, r in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="32,128")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base", default="", help="a worktree of the commit to compare with")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    rows = [("this checkout", REPO_ROOT)] + ([("base", Path(args.base).resolve())] if args.base else [])
    results = {label: run_checkout(path, streams, args.steps, args.repeats) for label, path in rows}
    print(f"\nCPU ms per generation step, {args.steps} steps, best of {args.repeats}\n")
    print("| checkout | streams | schedule | encode | update | detokenize | all |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in streams:
        for label, _ in rows:
            r = results[label][n]
            cells = " | ".join(f"{r[p]:.2f}" for p in ("schedule", "encode", "update", "detokenize"))
            print(f"| {label} | {n} | {cells} | {sum(r.values()):.2f} |")


if __name__ == "__main__":
    main()
