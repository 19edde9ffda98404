"""Replicas on one machine behind the client's round robin: does throughput add up until the cores run out?

    python benchmarks/replicas.py [--replicas 1,2,4] [--words 8,64] [--texts 384] [--repeats 2] [--dtype float32]

Each replica is its own `embedserv serve` of the bundled all-MiniLM-L6-v2 with its own gRPC and metrics ports,
started pinned (sched_setaffinity, which its worker process inherits) to its share of this process's cores: with
R replicas on C cores, replica i gets C / R cores of its own when R <= C, and core i mod C when R > C (then
replicas share a core). Each worker runs as many torch threads as it has cores (the server counts its affinity),
so the replicas' thread teams do not fight over one core. The load is one embedserv_client.Client on a
multi-address target (`ipv4:127.0.0.1:P1,127.0.0.1:P2,...`, gRPC's round_robin over them, as over a headless
Service's pods), --per-call texts a call with 2 x R calls in flight. Texts are stdlib docstrings cut to --words
words; the table gives their tokens as the server counts them. Every replica set stays up for the whole run and
the passes take turns, so the machine's drift hits each alike; the best pass counts. The load generator shares
the cores with the replicas: on a small machine it takes a visible share.

The last column is each replica's share of the Embed calls (its /metrics), which shows the round robin spread.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv_client import Client  # noqa: E402
from tests.helpers.metrics import scrape  # noqa: E402
from tests.helpers.server import free_port, server_env, stop_process, wait_until_serving  # noqa: E402

START_TIMEOUT_S = 300


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def core_shares(replicas: int, cores: list[int]) -> list[list[int]]:
    """Each replica's cores: an equal share of its own, or (more replicas than cores) one core, shared."""
    if replicas <= len(cores):
        share = len(cores) // replicas
        return [cores[i * share : (i + 1) * share] for i in range(replicas)]
    return [[cores[i % len(cores)]] for i in range(replicas)]


def texts_of(words: int, count: int) -> list[str]:
    """`count` real texts, each its first `words` words (the shorter ones whole); none empty."""
    cut = [" ".join(t.split()[:words]) for t in stdlib_texts(count * 2, seed=words)]
    return [t for t in cut if len(t.split()) >= min(words, 4)][:count]


class Replica:
    """One `embedserv serve` pinned to `cores`; always stopped by stop()."""

    def __init__(self, cores: list[int], dtype: str) -> None:
        self.cores, self.port, self.metrics_port = cores, free_port(), free_port()
        self.log_path = Path(tempfile.mkdtemp(prefix="embedserv-replicas-")) / "server.log"
        cmd = [sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-port", "0", "--metrics-port", str(self.metrics_port), "--dtype", dtype,
               "--log-level", "warning"]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.sched_setaffinity(0, cores),
            )  # fmt: skip

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self) -> None:
        wait_until_serving(self.address, lambda: self.proc.poll() is None, self.log_path, START_TIMEOUT_S)

    def embed_calls(self) -> float:
        return scrape(self.metrics_port).total("embedserv_requests_total", rpc="Embed", status="OK")

    def stop(self) -> None:
        stop_process(self.proc)


def one_pass(target: str, texts: list[str], per_call: int, in_flight: int) -> float:
    """Seconds to embed `texts` through the round robin."""
    with Client(target, batch_size=per_call, parallel_requests=in_flight, timeout=600) as client:
        client.embed(texts[:per_call], truncate=True)  # connects to every address before the clock starts
        start = time.perf_counter()
        client.embed(texts, truncate=True)
        return time.perf_counter() - start


def mean_tokens(target: str, texts: list[str]) -> float:
    with Client(target) as client:
        return sum(len(tokens) for tokens in client.tokenize(texts)) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=_ints, default=[1, 2, 4])
    parser.add_argument("--words", type=_ints, default=[8, 64], help="words per text, one table row each")
    parser.add_argument("--texts", type=int, default=384, help="texts per pass")
    parser.add_argument("--per-call", type=int, default=16, help="texts per call")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    corpus = {words: texts_of(words, args.texts) for words in args.words}
    sets: dict[int, list[Replica]] = {}
    best: dict[tuple[int, int], float] = {}
    try:
        for count in args.replicas:
            sets[count] = [Replica(share, args.dtype) for share in core_shares(count, cores)]
        for replicas in sets.values():
            for replica in replicas:
                replica.wait()
        targets = {count: "ipv4:" + ",".join(r.address for r in replicas) for count, replicas in sets.items()}
        tokens = {words: mean_tokens(targets[args.replicas[0]], texts) for words, texts in corpus.items()}
        before = {count: [r.embed_calls() for r in replicas] for count, replicas in sets.items()}
        for _ in range(args.repeats):
            for words, texts in corpus.items():
                for count, target in targets.items():
                    seconds = one_pass(target, texts, args.per_call, 2 * count)
                    best[(words, count)] = min(best.get((words, count), seconds), seconds)
        shares = {}
        for count, replicas in sets.items():
            calls = [r.embed_calls() - b for r, b in zip(replicas, before[count])]
            shares[count] = " / ".join(f"{c / max(sum(calls), 1):.0%}" for c in calls)
    finally:
        for replicas in sets.values():
            for replica in replicas:
                replica.stop()
    _print_table(args, cores, corpus, tokens, best, shares, sets)


def _print_table(args, cores, corpus, tokens, best, shares, sets) -> None:
    print(f"\nall-MiniLM-L6-v2, {args.dtype}, {len(cores)} cores, {args.texts} texts a pass in calls of "
          f"{args.per_call}, 2 calls in flight per replica, best of {args.repeats}\n")  # fmt: skip
    print("| tokens/text | replicas | cores each | texts/s | tokens/s | vs 1 replica | Embed calls per replica |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for words, texts in corpus.items():
        base = None
        for count, replicas in sets.items():
            rate = len(texts) / best[(words, count)]
            base = base or rate
            each = ", ".join("+".join(map(str, r.cores)) for r in replicas)
            print(f"| {tokens[words]:.0f} | {count} | {each} | {rate:.1f} | {rate * tokens[words]:.0f} | "
                  f"{rate / base:.2f}x | {shares[count]} |")  # fmt: skip


if __name__ == "__main__":
    main()
