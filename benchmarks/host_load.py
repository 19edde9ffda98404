"""The load generator of benchmarks/host_ceiling.py: many small calls in flight, as cheap on the client as we can
make them, so that the server's host path, not the client, is what runs out.

- HTTP: a bare HTTP/1.1 keep-alive client on asyncio streams, one connection per call in flight, posting
  OpenAI `/v1/embeddings` bodies (base64 vectors); every server speaks it (uvicorn under vLLM and under us).
  httpx costs several times more client CPU per call, which on 2 shared cores would cap every server alike.
- gRPC: grpc.aio, embedserv.v1.Inference/Embed with raw float32 bytes, over GRPC_CONNECTIONS connections;
  the server's own Timing comes back too.

Every call's answer is checked (status, one vector per text): a server that fails calls does not get a figure.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from tests.helpers.processes import child_pids
from tests.helpers.processes import role as process_role

GRPC_CONNECTIONS = 8


@dataclass
class LoadResult:
    texts_per_s: float
    seconds: float
    # Per-call wall times (seconds), in completion order.
    latencies: list[float]
    # CPU seconds the load generator itself used (this process).
    client_cpu_s: float
    # gRPC only: the server's Timing per call, summed (microseconds per field).
    timing_us: dict[str, float] = field(default_factory=dict)
    # Calls in every pass measure() made (warm-up included), and the server's CPU ms per call by process role.
    num_calls: int = 0
    cpu_ms_per_call: dict[str, float] = field(default_factory=dict)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1e3)


class HttpEmbedder:
    """One keep-alive connection: `await embed(texts)` posts one call and waits for its answer."""

    def __init__(self, url: str, model: str, extra: dict) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port, parts.path
        self.model, self.extra = model, extra
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def embed(self, texts: list[str]) -> dict[str, float]:
        body = json.dumps({"input": texts, "model": self.model, "encoding_format": "base64", **self.extra}).encode()
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        reply = await self.reader.readexactly(length)
        if b" 200 " not in status_line:
            raise RuntimeError(
                f"{status_line.decode().strip()} from {self.path}: {reply[:300].decode(errors='replace')}"
            )
        rows = json.loads(reply)["data"]
        if len(rows) != len(texts) or not base64.b64decode(rows[0]["embedding"]):
            raise RuntimeError(f"{len(rows)} vectors for {len(texts)} texts")
        return {}


class GrpcEmbedder:
    def __init__(self, stub, pb) -> None:
        self.stub, self.pb = stub, pb

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def embed(self, texts: list[str]) -> dict[str, float]:
        reply = await self.stub.Embed(
            self.pb.EmbedRequest(inputs=texts, truncate=True, encoding=self.pb.ENCODING_BYTES)
        )
        if len(reply.embeddings) != len(texts) or not reply.embeddings[0].raw:
            raise RuntimeError(f"{len(reply.embeddings)} vectors for {len(texts)} texts")
        t = reply.timing
        return {"tokenization": t.tokenization_us, "queue": t.queue_us, "inference": t.inference_us,
                "total": t.total_us}  # fmt: skip


async def run_load(make_client, batches: list[list[str]], concurrency: int) -> LoadResult:
    """All `batches` as calls, `concurrency` in flight, each on its own client (connection for HTTP)."""
    clients = [make_client() for _ in range(concurrency)]
    await asyncio.gather(*(c.connect() for c in clients))
    latencies: list[float] = []
    timing: dict[str, float] = {}
    pending = iter(batches)

    async def drive(client) -> None:
        for batch in pending:
            start = time.perf_counter()
            server = await client.embed(batch)
            latencies.append(time.perf_counter() - start)
            for key, value in server.items():
                timing[key] = timing.get(key, 0.0) + value

    cpu, start = time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(drive(c) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    seconds = time.perf_counter() - start
    texts = sum(len(b) for b in batches)
    return LoadResult(texts / seconds, seconds, latencies, time.process_time() - cpu, timing)


async def measure(target: dict, batches: list[list[str]], concurrency: int, repeats: int) -> LoadResult:
    """A warm-up pass over the first batches, then the fastest of `repeats` passes."""
    if target["protocol"] == "grpc":
        import grpc

        from embedserv.v1 import embedserv_pb2 as pb
        from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

        # Several connections, as many clients make: SO_REUSEPORT spreads connections, not calls, over the front
        # ends. A local subchannel pool keeps grpc from sharing one connection between the channels.
        options = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(target["url"], options=options) for _ in range(GRPC_CONNECTIONS)]
        stubs = itertools.cycle([pb_grpc.InferenceStub(channel) for channel in channels])
        try:
            return await _passes(lambda: GrpcEmbedder(next(stubs), pb), batches, concurrency, repeats)
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))
    return await _passes(lambda: HttpEmbedder(target["url"], target["model"], target["extra"]),
                         batches, concurrency, repeats)  # fmt: skip


async def _passes(make_client, batches, concurrency: int, repeats: int) -> LoadResult:
    warm_up = batches[: max(concurrency * 4, len(batches) // 10)]
    await run_load(make_client, warm_up, concurrency)
    best = None
    for _ in range(repeats):
        result = await run_load(make_client, batches, concurrency)
        if best is None or result.seconds < best.seconds:
            best = result
    best.num_calls = len(warm_up) + repeats * len(batches)
    return best


def _role(pid: int) -> str:
    kind = process_role(pid)
    return "server" if kind == "other" else kind


def _tree(pid: int) -> list[int]:
    """`pid` and every live process under it."""
    return [pid, *(grandchild for child in child_pids(pid) for grandchild in _tree(child))]


def cpu_by_role(server_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of the server and each process under it, with its role."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _tree(server_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (_role(pid), (int(fields[11]) + int(fields[12])) / tick)
    return out


def per_call(before: dict, after: dict, calls: int) -> dict[str, float]:
    """CPU ms per call by role, from two cpu_by_role snapshots (a process born between them counts whole)."""
    roles: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        roles[role] = roles.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return {role: seconds * 1000 / calls for role, seconds in roles.items()}
