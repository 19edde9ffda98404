"""Embedding throughput and latency over HTTP against gRPC on one embedserv server, and Infinity's HTTP server.

    python benchmarks/http_throughput.py [--texts 1000] [--calls 300] [--repeats 3] [--infinity-bin PATH]

Work: `--texts` real texts (benchmarks/corpus.py; the 15% over the bundled all-MiniLM-L6-v2's 256 tokens
are truncated), in three workloads: batches of 32 with 4 calls in flight; batches of 1 with 16 in flight;
and `--calls` one-text calls, one at a time (latency). Clients, each with its own connection(s):
- gRPC: a grpc.aio stub (ENCODING_BYTES, ENCODING_FLOAT) and embedserv_client.AsyncClient;
- HTTP: the openai SDK's AsyncOpenAI (encoding_format "float", and the SDK's default: it asks for base64
  and decodes it), httpx.AsyncClient posting JSON to /v1/embeddings (float, base64) and to TEI's /embed.
With `--infinity-bin` (Infinity's `infinity_emb` CLI), Infinity serves the same model directory after
embedserv has stopped, and the openai SDK and httpx rows run against its /embeddings.

Each server runs alone, float32 on the CPU. Every client's vectors are first checked against the gRPC
reference; one untimed pass of each workload warms the server up; then the rows take turns for
`--repeats` passes and the fastest pass counts, its calls giving the p50/p99 latencies. Tokens are the
server's count (gRPC usage: truncated, special tokens included), the same for every row and server.
Prints the CPU (name, AVX/AMX flags), the 1-minute load average before and after, and a markdown table
per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from benchmarks.core_ab import cpu_name  # noqa: E402
from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.embed_throughput import chunked, grpc_embed_calls  # noqa: E402
from embedserv.config import bundled_model_path  # noqa: E402
from embedserv.v1 import embedserv_pb2 as pb  # noqa: E402
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc  # noqa: E402
from embedserv_client import AsyncClient  # noqa: E402
from tests.helpers.server import free_port, log_tail, running_server, server_env, stop_process  # noqa: E402

NAME = "all-MiniLM-L6-v2"
Embed = Callable[[list[str]], Awaitable[np.ndarray]]
Opener = Callable[[], contextlib.AbstractAsyncContextManager[Embed]]
WORKLOADS = {"batches of 32, 4 in flight": (32, 4), "batches of 1, 16 in flight": (1, 16)}
LATENCY = "one text per call, sequential"


def vectors(rows: list) -> np.ndarray:
    """float lists, or base64 strings of little-endian float32, as one float32 array."""
    return np.stack([np.frombuffer(base64.b64decode(r), "<f4") if isinstance(r, str) else np.asarray(r, np.float32)
                     for r in rows])  # fmt: skip


@contextlib.asynccontextmanager
async def grpc_stub(target: str, encoding: int):
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def embed(texts: list[str]) -> np.ndarray:
            reply = await stub.Embed(pb.EmbedRequest(inputs=texts, truncate=True, encoding=encoding))
            return np.stack([np.frombuffer(e.raw, "<f4") if e.raw else np.asarray(e.values, np.float32)
                             for e in reply.embeddings])  # fmt: skip

        yield embed


@contextlib.asynccontextmanager
async def embedserv_client(target: str):
    async with AsyncClient(target) as client:
        yield lambda texts: client.embed(texts, truncate=True)


@contextlib.asynccontextmanager
async def openai_sdk(base_url: str, encoding: str | None, extra: dict | None):
    """`encoding` None: the SDK's default (it asks for base64 and decodes it to floats itself)."""
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        options = {"encoding_format": encoding} if encoding else {}

        async def embed(texts: list[str]) -> np.ndarray:
            reply = await client.embeddings.create(input=texts, model=NAME, extra_body=extra, **options)
            return vectors([d.embedding for d in reply.data])

        yield embed


@contextlib.asynccontextmanager
async def httpx_json(url: str, body: Callable[[list[str]], dict]):
    """POST body(texts) as JSON; an OpenAI-shaped or a TEI-shaped (list of lists) answer."""
    async with httpx.AsyncClient(timeout=300) as client:

        async def embed(texts: list[str]) -> np.ndarray:
            reply = await client.post(url, json=body(texts))
            reply.raise_for_status()
            payload = reply.json()
            return vectors([d["embedding"] for d in payload["data"]] if isinstance(payload, dict) else payload)

        yield embed


def openai_rows(server: str, url: str, extra: dict | None) -> dict[str, Opener]:
    """The openai SDK and httpx rows for an OpenAI-style /embeddings at `url` (its base URL)."""

    def body(encoding: str) -> Callable[[list[str]], dict]:
        return lambda texts: {"input": texts, "model": NAME, "encoding_format": encoding, **(extra or {})}

    return {
        f"{server} HTTP, openai SDK, float": lambda: openai_sdk(url, "float", extra),
        f"{server} HTTP, openai SDK, base64 (its default)": lambda: openai_sdk(url, None, extra),
        f"{server} HTTP, httpx JSON /embeddings, float": lambda: httpx_json(f"{url}/embeddings", body("float")),
        f"{server} HTTP, httpx JSON /embeddings, base64": lambda: httpx_json(f"{url}/embeddings", body("base64")),
    }


def embedserv_rows(target: str, http: str) -> dict[str, Opener]:
    tei = lambda texts: {"inputs": texts, "truncate": True}  # noqa: E731
    return {
        "gRPC, grpc.aio stub, ENCODING_BYTES": lambda: grpc_stub(target, pb.ENCODING_BYTES),
        "gRPC, grpc.aio stub, ENCODING_FLOAT": lambda: grpc_stub(target, pb.ENCODING_FLOAT),
        "gRPC, embedserv_client.AsyncClient": lambda: embedserv_client(target),
        **openai_rows("embedserv", f"{http}/v1", {"truncate": True}),
        "embedserv HTTP, httpx JSON TEI /embed": lambda: httpx_json(f"{http}/embed", tei),
    }


async def one_pass(embed: Embed, batches: list[list[str]], concurrency: int) -> tuple[float, list[float]]:
    """Wall seconds for all batches with `concurrency` calls in flight, and each call's seconds."""
    pending, latencies = iter(batches), []

    async def worker() -> None:
        for batch in pending:
            start = time.perf_counter()
            await embed(batch)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


async def measure(
    rows: dict[str, Opener], work: dict[str, tuple[list, int]], check: list[str], reference: np.ndarray, repeats: int
) -> dict[tuple[str, str], tuple[float, list[float]]]:
    """{(row, workload): (seconds, latencies) of the fastest pass}. Each row's vectors for `check` must
    match `reference`; one warm-up pass of each workload; then the rows take turns."""
    best: dict[tuple[str, str], tuple[float, list[float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(opener()) for name, opener in rows.items()}
        for name, embed in clients.items():
            got = await embed(check)
            assert np.allclose(got, reference, atol=1e-4), f"{name}: max diff {np.abs(got - reference).max()}"
        first = next(iter(clients.values()))
        for batches, concurrency in work.values():
            await one_pass(first, batches, concurrency)
        for _ in range(repeats):
            for name, embed in clients.items():
                for workload, (batches, concurrency) in work.items():
                    result = await one_pass(embed, batches, concurrency)
                    if (name, workload) not in best or result[0] < best[name, workload][0]:
                        best[name, workload] = result
    return best


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited; log tail:\n{log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout:.0f}s; log tail:\n{log_tail(log)}")


@contextlib.contextmanager
def infinity_server(binary: str, model: str):
    port = free_port()
    cmd = [binary, "v2", "--model-id", model, "--served-model-name", NAME, "--port", str(port), "--engine", "torch",
           "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    print("Infinity:", " ".join(cmd), flush=True)
    log = Path(f"/tmp/infinity-{port}.log")
    env = {**server_env(), "DO_NOT_TRACK": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", proc, log)
        yield url
    finally:
        stop_process(proc)


def table(title: str, best: dict, rows: list[str], texts: int, tokens: int) -> None:
    print(
        f"\n{title}\n\n| client | texts/s | tokens/s | p50 ms | p99 ms | vs gRPC bytes |"
        "\n|---|---:|---:|---:|---:|---:|"
    )
    base = texts / best[rows[0]][0]
    for name in rows:
        seconds, latencies = best[name]
        latencies = sorted(latencies)
        p50, p99 = latencies[len(latencies) // 2], latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        print(f"| {name} | {texts / seconds:.1f} | {tokens / seconds:.0f} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} "
              f"| {texts / seconds / base:.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=300, help="one-text calls of the latency workload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--infinity-bin", default=None, help="Infinity's infinity_emb CLI; else no Infinity rows")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    texts = stdlib_texts(args.texts)
    work = {name: (chunked(texts, size), flight) for name, (size, flight) in WORKLOADS.items()}
    work[LATENCY] = (chunked(texts[: args.calls], 1), 1)
    model = str(bundled_model_path())
    http_port = free_port()
    server_args = ["--model", model, "--served-model-name", NAME, "--dtype", "float32", "--device", "cpu",
                   "--log-level", "warning", "--http-port", str(http_port)]  # fmt: skip
    with running_server(server_args) as (target, proc):
        http = f"http://127.0.0.1:{http_port}"
        wait_http(f"{http}/health", proc, proc.log_path)
        tokens = asyncio.run(grpc_embed_calls(target, chunked(texts, 32), 4))
        latency_tokens = asyncio.run(grpc_embed_calls(target, chunked(texts[: args.calls], 1), 16))

        async def reference() -> np.ndarray:
            async with grpc_stub(target, pb.ENCODING_FLOAT) as embed:
                return await embed(texts[:32])

        ref = asyncio.run(reference())
        rows = embedserv_rows(target, http)
        best = asyncio.run(measure(rows, work, texts[:32], ref, args.repeats))
    if args.infinity_bin:
        with infinity_server(args.infinity_bin, model) as url:
            infinity = openai_rows("Infinity", url, None)
            best.update(asyncio.run(measure(infinity, work, texts[:32], ref, args.repeats)))
        rows.update(infinity)
    print(
        f"\nCPU: {cpu_name()}; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"{args.texts} texts, {tokens} tokens; float32; best of {args.repeats} passes"
    )
    for workload in work:
        count, count_tokens = (args.calls, latency_tokens) if workload == LATENCY else (args.texts, tokens)
        row_best = {name: best[name, workload] for name in rows}
        table(f"{workload} ({count} texts, {count_tokens} tokens)", row_best, list(rows), count, count_tokens)


if __name__ == "__main__":
    main()
