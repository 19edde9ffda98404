"""Replicas on one machine behind the client's round robin: does throughput add up until the cores run out?

    python benchmarks/replicas.py [--replicas 1,2,4] [--cores-per-replica 1] [--words 8,64] [--texts 256]
                                  [--repeats 3] [--dtype float32]

Each replica is its own `embedserv serve` of the bundled all-MiniLM-L6-v2 with its own gRPC and metrics ports,
started pinned (sched_setaffinity, which its worker process inherits) to --cores-per-replica cores: replica i
takes the next ones of this process's cores, wrapping around when the replicas need more cores than there are
(then they share them). Each worker runs as many torch threads as it has cores (the server counts its affinity),
so a replica's threads keep to its own cores. With 1 core each on 2 cores, 1 and 2 replicas should scale and 4
should not: that is the cores running out. The load is one embedserv_client.Client on a multi-address target
(`ipv4:127.0.0.1:P1,127.0.0.1:P2,...`, gRPC's round_robin over them, as over a headless Service's pods), calls
of --per-call texts with 2 x R in flight. Texts are stdlib docstrings cut to --words words; the table gives
their tokens as the server counts them. Every replica set stays up for the whole run and the passes take turns,
so the machine's drift hits each alike; the best pass counts. The load generator is not pinned and shares the
cores with the replicas; the header gives the load average before and after, which shows whether other work
shared the machine.

"cores busy" is the replicas' CPU seconds (server and worker processes, from /proc) over the pass's wall time:
how much of the machine they got. "CPU ms/text" is what a text cost them: when it holds steady as replicas are
added, they do not slow each other, and throughput is cores busy / CPU per text. On a machine other work shares,
these two columns stay readable when texts/s does not. The last column is each replica's share of the Embed
calls (its /metrics), which shows the round robin spread.
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


def core_shares(replicas: int, per_replica: int, cores: list[int]) -> list[list[int]]:
    """Each replica's cores: the next `per_replica` of `cores`, wrapping around when they run out."""
    if not 1 <= per_replica <= len(cores):
        raise SystemExit(f"--cores-per-replica must be 1..{len(cores)} (this process's cores), not {per_replica}")
    return [[cores[(i * per_replica + j) % len(cores)] for j in range(per_replica)] for i in range(replicas)]


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


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and its descendants (the server and its workers), from /proc."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                after_name = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(after_name[1]), int(after_name[11]) + int(after_name[12]))  # ppid, ticks
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")


def one_pass(target: str, texts: list[str], per_call: int, replicas: list[Replica]) -> tuple[float, float]:
    """(seconds, the replicas' CPU seconds) to embed `texts` through the round robin."""
    with Client(target, batch_size=per_call, parallel_requests=2 * len(replicas), timeout=600) as client:
        client.embed(texts[:per_call], truncate=True)  # connects to every address before the clock starts
        cpu = sum(tree_cpu_seconds(r.proc.pid) for r in replicas)
        start = time.perf_counter()
        client.embed(texts, truncate=True)
        seconds = time.perf_counter() - start
        return seconds, sum(tree_cpu_seconds(r.proc.pid) for r in replicas) - cpu


def mean_tokens(target: str, texts: list[str]) -> float:
    with Client(target) as client:
        return sum(len(tokens) for tokens in client.tokenize(texts)) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=_ints, default=[1, 2, 4])
    parser.add_argument("--cores-per-replica", type=int, default=1)
    parser.add_argument("--words", type=_ints, default=[8, 64], help="words per text, one table row each")
    parser.add_argument("--texts", type=int, default=256, help="texts per pass")
    parser.add_argument("--per-call", type=int, default=16, help="texts per call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    corpus = {words: texts_of(words, args.texts) for words in args.words}
    sets: dict[int, list[Replica]] = {}
    best: dict[tuple[int, int], tuple[float, float]] = {}  # (words, replicas) -> (seconds, CPU seconds)
    try:
        for count in args.replicas:
            sets[count] = [Replica(share, args.dtype) for share in core_shares(count, args.cores_per_replica, cores)]
        for replicas in sets.values():
            for replica in replicas:
                replica.wait()
        targets = {count: "ipv4:" + ",".join(r.address for r in replicas) for count, replicas in sets.items()}
        tokens = {words: mean_tokens(targets[args.replicas[0]], texts) for words, texts in corpus.items()}
        before = {count: [r.embed_calls() for r in replicas] for count, replicas in sets.items()}
        for _ in range(args.repeats):
            for words, texts in corpus.items():
                for count, target in targets.items():
                    seconds, cpu = one_pass(target, texts, args.per_call, sets[count])
                    if seconds < best.get((words, count), (float("inf"), 0.0))[0]:
                        best[(words, count)] = (seconds, cpu)
        shares = {}
        for count, replicas in sets.items():
            calls = [r.embed_calls() - b for r, b in zip(replicas, before[count], strict=True)]
            shares[count] = " / ".join(f"{c / max(sum(calls), 1):.0%}" for c in calls)
    finally:
        for replicas in sets.values():
            for replica in replicas:
                replica.stop()
    print(f"\nload average (1 min) before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")
    _print_table(args, cores, corpus, tokens, best, shares, sets)


def _print_table(args, cores, corpus, tokens, best, shares, sets) -> None:
    print(f"all-MiniLM-L6-v2, {args.dtype}, {len(cores)} cores, {args.texts} texts a pass in calls of "
          f"{args.per_call}, 2 calls in flight per replica, best of {args.repeats}\n")  # fmt: skip
    first = f"{args.replicas[0]} replica" + ("s" if args.replicas[0] > 1 else "")
    print(f"| tokens/text | replicas | cores each | texts/s | tokens/s | vs {first} | cores busy | CPU ms/text "
          "| Embed calls per replica |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for words, texts in corpus.items():
        base = None
        for count, replicas in sets.items():
            seconds, cpu = best[(words, count)]
            rate = len(texts) / seconds
            base = base or rate
            each = ", ".join("+".join(map(str, r.cores)) for r in replicas)
            busy, per_text = cpu / seconds, 1000 * cpu / len(texts)
            print(f"| {tokens[words]:.0f} | {count} | {each} | {rate:.1f} | {rate * tokens[words]:.0f} | "
                  f"{rate / base:.2f}x | {busy:.2f} | {per_text:.2f} | {shares[count]} |")  # fmt: skip


if __name__ == "__main__":
    main()
