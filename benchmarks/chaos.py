"""Chaos: mixed load on a `--frontends 2 --data-parallel-size 2` server while processes are killed; every call counted.

    python benchmarks/chaos.py --minutes 3 [--concurrency 12] [--kill-every 20] [--drain-timeout 10] [--json PATH]

The server serves the bundled MiniLM (embed), a random-weight cross-encoder (rerank) and a small random Llama
(generate), as benchmarks/soak.py builds them. Before any fault, each request of a fixed pool (embed, rerank,
generate) is answered once over gRPC: those are the known answers. Then --concurrency slots call without pause,
each call a random pool request on a random face (gRPC, or HTTP: /v1/embeddings, /v1/rerank, streamed
/v1/completions), while every --kill-every seconds a random worker and then a random front end get SIGKILL. At
--minutes, SIGTERM starts a drain with the load still running; the server must then exit 0.

Each call ends as one of:
- ok: the known answer (vectors and scores within 1e-4, generated text equal) and, for streams, a finish reason;
- retryable: gRPC UNAVAILABLE, HTTP 503 with Retry-After, the connection lost before any answer (its front end
  was killed), or a stream's error event that says why (after its first tokens);
- overloaded: RESOURCE_EXHAUSTED / 429 (the client backs off and retries);
- wrong: anything else: another answer, another status, a stream ending without a finish reason, or no end
  within --call-timeout (lost).
Nothing may be wrong. The table splits the calls by face and by the last event before each call started.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httpx
import numpy as np

from benchmarks.corpus import stdlib_texts
from benchmarks.soak import SERVED_NAMES, header, model_dirs
from embedserv.v1 import embedserv_pb2 as pb
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import response_matrix
from tests.helpers.processes import frontend_pids, worker_pids
from tests.helpers.server import free_port, server_env, wait_until_serving

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("ok", "retryable", "overloaded", "wrong")
TOLERANCE = 1e-4


class Pool:
    """The requests calls draw from, and their known answers once `learn` has run."""

    def __init__(self, seed: int = 3) -> None:
        rng, texts = random.Random(seed), stdlib_texts(400, seed=seed)
        words = " ".join(texts).split()
        self.requests = [("embed", {"texts": rng.sample(texts, 4)}) for _ in range(24)]
        self.requests += [
            ("rerank", {"query": " ".join(rng.choice(texts).split()[:8]), "documents": rng.sample(texts, 6)})
            for _ in range(16)
        ]
        for _ in range(8):
            start = rng.randrange(len(words) - 40)
            self.requests.append(("generate", {"prompt": " ".join(words[start : start + 30]), "max_tokens": 16}))
        self.answers: list[object] = []

    async def learn(self, calls: dict) -> None:
        self.answers = [await calls[kind](**arguments) for kind, arguments in self.requests]

    def same(self, index: int, answer: object) -> bool:
        known = self.answers[index]
        if isinstance(known, str):
            return answer == known
        return bool(np.shape(answer) == np.shape(known) and np.allclose(answer, known, rtol=0, atol=TOLERANCE))


class Retryable(Exception):
    """A refusal or a cut a client may retry."""


class Overloaded(Exception):
    pass


class Wrong(Exception):
    pass


@contextlib.asynccontextmanager
async def grpc_faces(target: str):
    """{kind: call} over gRPC; each returns the answer in the form Pool compares."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def embed(texts):
            request = pb.EmbedRequest(
                model=SERVED_NAMES["embed"], inputs=texts, truncate=True, encoding=pb.ENCODING_BYTES
            )
            return response_matrix(await stub.Embed(request))

        async def rerank(query, documents):
            request = pb.RerankRequest(model=SERVED_NAMES["rerank"], query=query, documents=documents, truncate=True)
            results = (await stub.Rerank(request)).results
            return np.array([score for _, score in sorted((r.index, r.score) for r in results)], dtype=np.float32)

        async def generate(prompt, max_tokens):
            request = pb.GenerateRequest(model=SERVED_NAMES["generate"], prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, ignore_eos=True)  # fmt: skip
            text, finish = "", 0
            async for reply in stub.Generate(request):
                text, finish = text + reply.text, reply.finish_reason or finish
            if not finish:
                raise Wrong("the stream ended without a finish reason")
            return text

        yield {"embed": embed, "rerank": rerank, "generate": generate}


def _refusal(reply: httpx.Response) -> Exception:
    if reply.status_code == 503 and "retry-after" in reply.headers:
        return Retryable(f"503: {reply.text[:120]}")
    if reply.status_code == 429:
        return Overloaded(reply.text[:120])
    return Wrong(f"HTTP {reply.status_code} ({'with' if 'retry-after' in reply.headers else 'no'} Retry-After): "
                 f"{reply.text[:160]}")  # fmt: skip


@contextlib.asynccontextmanager
async def http_faces(base_url: str):
    async with httpx.AsyncClient(base_url=base_url, timeout=None) as client:

        async def post(path: str, kind: str, body: dict) -> dict:
            reply = await client.post(path, json={"model": SERVED_NAMES[kind], **body})
            if reply.status_code != 200:
                raise _refusal(reply)
            return reply.json()

        async def embed(texts):
            data = (await post("/v1/embeddings", "embed", {"input": texts, "truncate": True}))["data"]
            return np.array([row["embedding"] for row in sorted(data, key=lambda row: row["index"])], dtype=np.float32)

        async def rerank(query, documents):
            body = {"query": query, "documents": documents, "truncate": True, "return_documents": False}
            results = (await post("/v1/rerank", "rerank", body))["results"]
            ordered = sorted((r["index"], r["relevance_score"]) for r in results)
            return np.array([score for _, score in ordered], dtype=np.float32)

        async def generate(prompt, max_tokens):
            body = {"model": SERVED_NAMES["generate"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            text, finish, done = "", None, False
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    raise _refusal(reply)
                async for line in reply.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            raise Retryable(f"stream error event: {str(event['error'])[:120]}")
                        choice = event["choices"][0]
                        text, finish = text + choice["text"], choice["finish_reason"] or finish
            if finish is None or not done:
                raise Wrong(f"the stream ended without {'a finish reason' if finish is None else '[DONE]'}")
            return text

        yield {"embed": embed, "rerank": rerank, "generate": generate}


def classify(err: BaseException) -> tuple[str, str]:
    if isinstance(err, grpc.aio.AioRpcError):
        code = err.code()
        if code is grpc.StatusCode.UNAVAILABLE:
            return "retryable", f"UNAVAILABLE: {err.details()}"
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded", err.details() or ""
        return "wrong", f"{code.name}: {err.details()}"
    if isinstance(err, Retryable):
        return "retryable", str(err)
    if isinstance(err, Overloaded):
        return "overloaded", str(err)
    if isinstance(err, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "retryable", f"connection lost: {type(err).__name__}"
    if isinstance(err, asyncio.TimeoutError):
        return "wrong", "no end within --call-timeout (lost)"
    return "wrong", f"{type(err).__name__}: {err}"


class Ledger:
    """Every call: (face, kind, phase) -> outcome counts, and the reasons of all that were not ok."""

    def __init__(self) -> None:
        self.phase = "steady"
        self.counts: dict[tuple[str, str, str], collections.Counter] = collections.defaultdict(collections.Counter)
        self.reasons: collections.Counter = collections.Counter()

    def record(self, face: str, kind: str, phase: str, outcome: str, reason: str = "") -> None:
        self.counts[(face, kind, phase)][outcome] += 1
        if outcome != "ok":
            self.reasons[(outcome, phase, face, reason[:140])] += 1


async def slot(index: int, faces: dict, pool: Pool, ledger: Ledger, timeout: float, stop: asyncio.Event) -> None:
    rng = random.Random(index)
    while not stop.is_set():
        face = rng.choice(tuple(faces))
        request = rng.randrange(len(pool.requests))
        kind, arguments = pool.requests[request]
        phase = ledger.phase
        try:
            answer = await asyncio.wait_for(faces[face][kind](**arguments), timeout)
        except Exception as err:
            outcome, reason = classify(err)
            ledger.record(face, kind, phase, outcome, reason)
            await asyncio.sleep(0.2)  # a refused client backs off
            continue
        same = pool.same(request, answer)
        ledger.record(
            face, kind, phase, "ok" if same else "wrong", "" if same else "an answer other than the known one"
        )


async def faults(proc: subprocess.Popen, ledger: Ledger, args, events: list[dict]) -> None:
    """SIGKILL a random worker, then a random front end, every --kill-every seconds, in turn."""
    rng, victims = random.Random(11), ("worker", "frontend")
    for number in range(10**6):
        await asyncio.sleep(args.kill_every)
        what = victims[number % 2]
        pids = worker_pids(proc.pid) if what == "worker" else frontend_pids(proc.pid)
        if not pids:
            events.append({"t": round(time.monotonic() - args.started, 1), "event": f"no {what} to kill"})
            continue
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        ledger.phase = f"after {what} kill"
        events.append({"t": round(time.monotonic() - args.started, 1), "event": f"SIGKILL {what} {pid}"})
        print(f"{events[-1]['t']:7.1f}s  SIGKILL {what} {pid}", flush=True)


async def chaos(args, target: str, http_port: int, proc: subprocess.Popen) -> tuple[Ledger, list[dict], int | None]:
    pool, ledger, events = Pool(), Ledger(), []
    async with grpc_faces(target) as grpc_calls, http_faces(f"http://127.0.0.1:{http_port}") as http_calls:
        await pool.learn(grpc_calls)
        args.started = time.monotonic()
        stop = asyncio.Event()
        faces = {"grpc": grpc_calls, "http": http_calls}
        slots = [
            asyncio.create_task(slot(i, faces, pool, ledger, args.call_timeout, stop)) for i in range(args.concurrency)
        ]
        killer = asyncio.create_task(faults(proc, ledger, args, events))
        await asyncio.sleep(args.minutes * 60)
        killer.cancel()
        ledger.phase = "draining"
        proc.send_signal(signal.SIGTERM)
        events.append({"t": round(time.monotonic() - args.started, 1), "event": "SIGTERM (drain)"})
        exit_code = await asyncio.get_running_loop().run_in_executor(None, _wait, proc, args.drain_timeout + 60)
        stop.set()
        await asyncio.gather(*slots, return_exceptions=True)
    return ledger, events, exit_code


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def table(ledger: Ledger) -> list[dict]:
    rows = []
    for (face, kind, phase), counts in sorted(ledger.counts.items(), key=lambda item: (item[0][2], item[0][:2])):
        rows.append({"phase": phase, "face": face, "kind": kind, **{o: counts[o] for o in OUTCOMES}})
    return rows


def print_table(rows: list[dict], ledger: Ledger) -> None:
    print(f"\n{'phase':<20}{'face':<6}{'kind':<10}" + "".join(f"{o:>11}" for o in OUTCOMES))
    for row in rows:
        print(f"{row['phase']:<20}{row['face']:<6}{row['kind']:<10}" + "".join(f"{row[o]:>11}" for o in OUTCOMES))
    totals = {o: sum(row[o] for row in rows) for o in OUTCOMES}
    print(f"{'all':<36}" + "".join(f"{totals[o]:>11}" for o in OUTCOMES))
    print("\nwhy calls were not ok (count, outcome, phase, face, reason):")
    for (outcome, phase, face, reason), count in ledger.reasons.most_common(40):
        print(f"  {count:5d}  {outcome:<10} {phase:<20} {face:<5} {reason}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--call-timeout", type=float, default=120.0, help="a call with no end by then is lost")
    parser.add_argument("--json", type=Path, help="save the header, events and table here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="embedserv-chaos-"))
    models = model_dirs(("embed", "rerank", "generate"), scratch)
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(http_port), "--frontends", "2", "--data-parallel-size", "2",
           "--drain-timeout", str(args.drain_timeout), "--no-warm-up"]  # fmt: skip
    for kind, path in models.items():
        cmd += ["--model", str(path), "--served-model-name", SERVED_NAMES[kind]]
    log = scratch / "server.log"
    print(f"server log: {log}", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=server_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(f"127.0.0.1:{port}", lambda: proc.poll() is None, log, timeout=600)
        ledger, events, exit_code = asyncio.run(chaos(args, f"127.0.0.1:{port}", http_port, proc))
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = table(ledger)
    print_table(rows, ledger)
    print(f"\nevents: {events}\nserver exit code after the drain: {exit_code}")
    wrong = sum(row["wrong"] for row in rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        reasons = [
            {"count": c, "outcome": o, "phase": p, "face": f, "reason": r}
            for (o, p, f, r), c in ledger.reasons.most_common()
        ]
        result = {**header(), "args": {k: v for k, v in vars(args).items() if k not in ("json", "started")},
                  "events": events, "exit_code": exit_code, "table": rows, "reasons": reasons}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if wrong == 0 and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
