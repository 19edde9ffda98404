"""What the production edge costs per call: small Embed calls through gRPC, with and without it.

    python benchmarks/server_overhead.py [--calls 3000] [--concurrency 32] [--repeats 3] [--base DIR]

Each configuration is a real server with the bundled MiniLM; a grpc.aio client sends `--calls` calls of
one short text, `--concurrency` at a time, after an untimed warm-up pass. Small calls make the per-call
work (request id, status and metrics bookkeeping, the API-key check, TLS, log lines) as large a share
as it can be. `--base DIR` adds a row for another checkout (e.g. a `git worktree` of the commit before
the production edge). Servers take turns per repeat; the best pass counts (this machine drifts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402

from embedserv.v1 import embedserv_pb2 as pb  # noqa: E402
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc  # noqa: E402
from tests.helpers.server import free_port, running_server  # noqa: E402
from tests.helpers.tls import make_pki  # noqa: E402

KEY = "benchmark-key"


def configurations(pki: Path, base: str | None) -> dict[str, tuple[list[str], Path]]:
    tls = ["--tls-cert", str(pki / "server_cert.pem"), "--tls-key", str(pki / "server_key.pem")]

    def production() -> list[str]:
        return ["--api-key", KEY, "--metrics-port", str(free_port())]

    rows = {
        "logs at warning": (["--log-level", "warning"], REPO_ROOT),
        "default (info: a line per batch)": ([], REPO_ROOT),
        "+ metrics port + API key": (production(), REPO_ROOT),
        "+ metrics port + API key + TLS": (production() + tls, REPO_ROOT),
        "+ metrics port + API key, JSON logs": ([*production(), "--log-format", "json"], REPO_ROOT),
    }
    if base:
        rows[f"base checkout {Path(base).name} (info)"] = ([], Path(base))
    return rows


async def run_calls(target: str, credentials, calls: int, concurrency: int) -> tuple[float, list[float]]:
    """Wall seconds and per-call latencies (seconds)."""
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        stub = pb_grpc.InferenceStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        gate = asyncio.Semaphore(concurrency)
        latencies: list[float] = []

        async def one(i: int) -> None:
            async with gate:
                start = time.perf_counter()
                await stub.Embed(pb.EmbedRequest(inputs=[f"short text number {i}"]), metadata=metadata)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return time.perf_counter() - start, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", default=None, help="another checkout to run as one more row")
    args = parser.parse_args()
    pki = Path(tempfile.mkdtemp(prefix="bench-pki-"))
    pems = make_pki(pki)
    rows = configurations(pki, args.base)
    best: dict[str, tuple[float, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        targets = {}
        for name, (server_args, cwd) in rows.items():
            credentials = grpc.ssl_channel_credentials(pems["ca"]) if "--tls-cert" in server_args else None
            target, _ = stack.enter_context(running_server(server_args, credentials=credentials, cwd=cwd))
            targets[name] = (target, credentials)
            asyncio.run(run_calls(target, credentials, min(args.calls, 500), args.concurrency))
        for _ in range(args.repeats):
            for name, (target, credentials) in targets.items():
                result = asyncio.run(run_calls(target, credentials, args.calls, args.concurrency))
                if name not in best or result[0] < best[name][0]:
                    best[name] = result
    print(f"\n{args.calls} Embed calls of one short text, {args.concurrency} in flight, best of {args.repeats}\n")
    print("| server | calls/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, (seconds, latencies) in best.items():
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        print(f"| {name} | {args.calls / seconds:.0f} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
