"""Query latency under bulk load, with and without priority, against the idle server (issue 53).

    python benchmarks/priority_latency.py [--queries 200] [--bulk-calls 8] [--bulk-texts 256] [--in-flight 16]

One server (`embedserv serve`, the bundled MiniLM, float32, CPU) and three scenarios in one run:
- idle: `--queries` one-text calls, `--in-flight` at a time, nothing else running;
- bulk, priority off: the same queries while `--bulk-calls` calls of `--bulk-texts` texts each run (each bulk
  caller sends its next call as soon as one ends), every call at the default priority;
- bulk, queries at 10: the same, the queries at priority 10 (bulk steps shrink once the first query comes);
- bulk at -1: the bulk calls at priority -1, below the default (background work: short steps from the start).
It prints the queries' p50 / p99 and the bulk texts/s per scenario, and writes them as JSON (--json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv_client import AsyncClient  # noqa: E402
from tests.helpers.server import running_server  # noqa: E402


async def _queries(target: str, texts: list[str], in_flight: int, priority: int | None) -> list[float]:
    latencies: list[float] = []
    pending = iter(texts)
    async with AsyncClient(target, priority=priority, timeout=300) as client:

        async def loop() -> None:
            for text in pending:
                start = time.perf_counter()
                await client.embed([text], truncate=True)
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(loop() for _ in range(in_flight)))
    return latencies


async def _bulk(
    target: str, texts: list[str], calls: int, stop: asyncio.Event, priority: int | None
) -> tuple[int, float]:
    """Keeps `calls` bulk calls running until `stop`; (texts embedded, seconds)."""
    done = 0
    start = time.perf_counter()
    async with AsyncClient(target, timeout=600, batch_size=len(texts), priority=priority) as client:

        async def caller() -> None:
            nonlocal done
            while not stop.is_set():
                await client.embed(texts, truncate=True)
                done += len(texts)

        await asyncio.gather(*(caller() for _ in range(calls)))
    return done, time.perf_counter() - start


async def _scenario(target: str, args, queries: list[str], bulk: list[str] | None, priorities: tuple) -> dict:
    stop = asyncio.Event()
    priority, bulk_priority = priorities
    load = asyncio.create_task(_bulk(target, bulk, args.bulk_calls, stop, bulk_priority)) if bulk else None
    if load is not None:
        await asyncio.sleep(args.settle)  # the bulk calls are queued and running
    latencies = await _queries(target, queries, args.in_flight, priority)
    stop.set()
    bulk_texts, seconds = await load if load is not None else (0, 1.0)
    ms = np.array(latencies) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "bulk_texts_per_s": bulk_texts / seconds if load is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--bulk-calls", type=int, default=8)
    parser.add_argument("--bulk-texts", type=int, default=256)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of bulk load before the queries")
    parser.add_argument("--server-args", default="", help="more `embedserv serve` flags")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    texts = stdlib_texts(args.queries + args.bulk_texts, seed=3)
    queries, bulk = [t[:120] for t in texts[: args.queries]], texts[args.queries :]
    # Room for every bulk input at once, as a server sized for bulk indexing would be.
    server = ["--dtype", "float32", "--device", "cpu", "--log-level", "warning", "--max-concurrent-requests", "8192"]
    server += args.server_args.split()
    rows = {}
    with running_server(server) as (target, _):
        asyncio.run(_queries(target, queries[:32], args.in_flight, None))  # warm the server up
        for name, load, priorities in (
            ("idle", None, (None, None)),
            ("bulk, priority off", bulk, (None, None)),
            ("bulk, queries at 10", bulk, (10, None)),
            ("bulk at -1, queries at default", bulk, (None, -1)),
        ):
            rows[name] = asyncio.run(_scenario(target, args, queries, load, priorities))
    idle_p99 = rows["idle"]["p99_ms"]
    print(f"{'scenario':36} {'p50 ms':>9} {'p99 ms':>9} {'p99/idle':>9} {'bulk texts/s':>13}")
    for name, row in rows.items():
        bulk_rate = "" if row["bulk_texts_per_s"] is None else f"{row['bulk_texts_per_s']:.0f}"
        ratio = row["p99_ms"] / idle_p99
        print(f"{name:36} {row['p50_ms']:9.1f} {row['p99_ms']:9.1f} {ratio:9.2f} {bulk_rate:>13}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
        record = {
            "command": " ".join(sys.argv),
            "commit": commit.stdout.strip(),
            "cpu": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d"),
            "rows": rows,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
