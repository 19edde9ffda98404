"""What embedserv-client costs or gains against raw stubs, on one live server with the bundled MiniLM.

    python benchmarks/client_throughput.py [--texts 2048] [--repeats 3] [--small-calls 1000]

Big batch: `--texts` stdlib docstrings (truncated to 256 tokens) embedded in one go. The raw stub sends
requests of 256 (the server's default --max-client-batch-size) one after another, with ENCODING_FLOAT
and with ENCODING_BYTES; the clients split the batch themselves and keep `parallel_requests` in
flight. Small calls: `--small-calls` one-text calls from 8 threads (sync) or 32 tasks (async), which
shows the client's per-call overhead. Rows take turns per repeat; the best pass counts (this machine
drifts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv_client import AsyncClient, Client  # noqa: E402
from embedserv_client.v1 import embedserv_pb2 as pb  # noqa: E402
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc  # noqa: E402
from tests.helpers.server import running_server  # noqa: E402

CHUNK = 256


def raw_stub(target: str, texts: list[str], encoding: int) -> np.ndarray:
    options = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.InferenceStub(channel)
        rows = []
        for i in range(0, len(texts), CHUNK):
            reply = stub.Embed(pb.EmbedRequest(inputs=texts[i : i + CHUNK], truncate=True, encoding=encoding))
            for e in reply.embeddings:
                rows.append(np.frombuffer(e.raw, "<f4") if e.raw else np.asarray(e.values, np.float32))
        return np.stack(rows)


def sync_client(target: str, texts: list[str], parallel: int) -> np.ndarray:
    with Client(target, parallel_requests=parallel) as client:
        return client.embed(texts, truncate=True)


def async_client(target: str, texts: list[str]) -> np.ndarray:
    async def run() -> np.ndarray:
        async with AsyncClient(target) as client:
            return await client.embed(texts, truncate=True)

    return asyncio.run(run())


def small_sync_client(target: str, calls: int) -> None:
    with Client(target) as client, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.embed(f"short text number {i}"), range(calls)))


def small_sync_stub(target: str, calls: int) -> None:
    with grpc.insecure_channel(target) as channel, ThreadPoolExecutor(8) as pool:
        stub = pb_grpc.InferenceStub(channel)
        request = lambda i: pb.EmbedRequest(inputs=[f"short text number {i}"], encoding=pb.ENCODING_BYTES)  # noqa: E731
        list(pool.map(lambda i: stub.Embed(request(i)), range(calls)))


def small_async_client(target: str, calls: int) -> None:
    async def run() -> None:
        async with AsyncClient(target) as client:
            gate = asyncio.Semaphore(32)

            async def one(i: int) -> None:
                async with gate:
                    await client.embed(f"short text number {i}")

            await asyncio.gather(*(one(i) for i in range(calls)))

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-calls", type=int, default=1000)
    args = parser.parse_args()
    texts = stdlib_texts(args.texts)
    big = {
        "raw stub, ENCODING_FLOAT, 256 per request, one at a time": lambda t: raw_stub(t, texts, pb.ENCODING_FLOAT),
        "raw stub, ENCODING_BYTES, 256 per request, one at a time": lambda t: raw_stub(t, texts, pb.ENCODING_BYTES),
        "Client.embed, parallel_requests=1": lambda t: sync_client(t, texts, 1),
        "Client.embed, parallel_requests=4 (default)": lambda t: sync_client(t, texts, 4),
        "AsyncClient.embed (default)": lambda t: async_client(t, texts),
    }
    small = {
        "raw stub, 8 threads": lambda t: small_sync_stub(t, args.small_calls),
        "Client.embed, 8 threads": lambda t: small_sync_client(t, args.small_calls),
        "AsyncClient.embed, 32 tasks": lambda t: small_async_client(t, args.small_calls),
    }
    best: dict[str, float] = {}
    with running_server(["--dtype", "float32", "--device", "cpu", "--log-level", "warning"]) as (target, _):
        reference = raw_stub(target, texts[:CHUNK], pb.ENCODING_FLOAT)  # also the warm-up
        for name, run in big.items():
            assert np.allclose(run(target)[:CHUNK], reference, atol=1e-5), name
        for _ in range(args.repeats):
            for name, run in {**big, **small}.items():
                start = time.perf_counter()
                run(target)
                elapsed = time.perf_counter() - start
                best[name] = min(best.get(name, elapsed), elapsed)
    print(f"\nBig batch: {args.texts} texts (best of {args.repeats})\n")
    print("| path | texts/s | seconds |\n|---|---:|---:|")
    for name in big:
        print(f"| {name} | {args.texts / best[name]:.0f} | {best[name]:.2f} |")
    print(f"\nSmall calls: {args.small_calls} one-text calls (best of {args.repeats})\n")
    print("| path | calls/s |\n|---|---:|")
    for name in small:
        print(f"| {name} | {args.small_calls / best[name]:.0f} |")


if __name__ == "__main__":
    main()
