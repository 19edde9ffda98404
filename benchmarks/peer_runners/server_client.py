"""The load generator for the server peers: the same client for every server, run by the driver's interpreter
(embedserv's venv, which has httpx, grpcio and numpy):

    .venv/bin/python -m benchmarks.peer_runners.server_client JOB.json

Protocols: "openai" posts {"input": [...], "encoding_format": "base64", ...job["extra_body"]} to job["url"]
(vLLM, Infinity, embedserv's /v1/embeddings) with httpx; "grpc" calls embedserv.v1.Inference/Embed with
raw float32 bytes. It is the one runner that imports from embedserv: the generated gRPC stubs, nothing else.

Throughput: one warm-up pass over the first job["warmup_texts"] texts, then the fastest of job["repeats"]
passes over all texts, in requests of job["batch_size"] texts with job["concurrency"] requests in flight.
Latency: then job["latency_requests"] one-text requests, one at a time; p50 and p99 of their wall times.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Awaitable, Callable

import numpy as np

from .common import chunked, percentile, read_job, read_texts, write_result

Embed = Callable[[list[str]], Awaitable[np.ndarray]]


def latency_texts(texts: list[str], count: int) -> list[str]:
    """`count` texts spread evenly over the list (the same ones for every peer)."""
    return [texts[i * len(texts) // count] for i in range(count)]


@contextlib.asynccontextmanager
async def openai_client(job: dict):
    import httpx

    async with httpx.AsyncClient(timeout=job["request_timeout"]) as client:

        async def embed(texts: list[str]) -> np.ndarray:
            body = {"input": texts, "model": job["model_name"], "encoding_format": "base64", **job["extra_body"]}
            reply = await client.post(job["url"], json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code} from {job['url']}: {reply.text[:500]}")
            rows = sorted(reply.json()["data"], key=lambda row: row["index"])
            return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), "<f4") for row in rows])

        yield embed


@contextlib.asynccontextmanager
async def grpc_client(job: dict):
    import grpc

    from embedserv.v1 import embedserv_pb2 as pb
    from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(job["url"], options=options) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def embed(texts: list[str]) -> np.ndarray:
            request = pb.EmbedRequest(inputs=texts, truncate=True, encoding=pb.ENCODING_BYTES)
            reply = await stub.Embed(request, timeout=job["request_timeout"])
            return np.stack([np.frombuffer(e.raw, "<f4") for e in reply.embeddings])

        yield embed


async def one_pass(embed: Embed, batches: list[list[str]], concurrency: int) -> np.ndarray:
    """All batches with `concurrency` requests in flight; the vectors in the batches' order."""
    results: list[np.ndarray | None] = [None] * len(batches)
    pending = iter(range(len(batches)))

    async def worker() -> None:
        for index in pending:
            results[index] = await embed(batches[index])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return np.concatenate(results)


async def measure(job: dict) -> dict:
    texts = read_texts(job)
    batches = chunked(texts, job["batch_size"])
    opener = {"openai": openai_client, "grpc": grpc_client}[job["protocol"]]
    async with opener(job) as embed:
        await one_pass(embed, chunked(texts[: job["warmup_texts"]], job["batch_size"]), job["concurrency"])
        best, vectors = float("inf"), None
        for _ in range(job["repeats"]):
            start = time.perf_counter()
            vectors = await one_pass(embed, batches, job["concurrency"])
            best = min(best, time.perf_counter() - start)
        latencies = []
        for text in latency_texts(texts, job["latency_requests"]):
            start = time.perf_counter()
            await embed([text])
            latencies.append(time.perf_counter() - start)
    return {"seconds": best, "vectors": vectors, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3}  # fmt: skip


def main() -> None:
    job = read_job()
    result = asyncio.run(measure(job))
    setup = f"{job['batch_size']} texts/request, {job['concurrency']} in flight, {job['protocol']}"
    write_result(job, result.pop("vectors"), setup=setup, **result)


if __name__ == "__main__":
    main()
