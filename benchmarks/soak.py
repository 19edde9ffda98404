"""Soak test: hold a steady load on a real `embedserv serve` for N minutes and watch each process's memory.

    python benchmarks/soak.py --load {embed,rerank,generate,mixed} --minutes 30
        [--concurrency 8] [--batch 32] [--protocol grpc|http] [--interval 60] [--warm-up-minutes 5]
        [--data-parallel-size 1] [--dtype auto] [--json PATH] [--server-arg=ARG ...]

Models, nothing downloaded: the bundled all-MiniLM-L6-v2 (embed), a random-weight cross-encoder (rerank) and
4-layer Llama (generate); mixed serves all three. Seeded calls on real texts: --batch texts to embed; a query
and --batch documents to rerank; a 10-200 word prompt for 8-64 greedy tokens, EOS ignored (not over HTTP:
/v1/completions has no ignore_eos). --concurrency calls stay in flight (with mixed, each slot cycles the kinds);
a failed call is counted and the load goes on. Every --interval seconds, and before the load (minute 0), a row:
RSS, open fds, threads of the server and each child (workers by WorkerArgs name, e.g. minilm/0; a changed pid
is a restart), the interval's answered calls, errors, calls/s, p50/p99 ms. At the end, per process: RSS at the
warm-up's end, at the end, peak, and the least-squares slope (MiB/minute) from --warm-up-minutes on; per kind:
calls, errors, p50, p99. --server-arg=ARG (with `=` when ARG starts with dashes) goes to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httpx

from benchmarks.core_ab import cpu_name
from benchmarks.corpus import stdlib_texts
from benchmarks.soak_report import Monitor, Tally, summarize
from embedserv import cpu_isa
from embedserv.config import bundled_model_path
from embedserv.v1 import embedserv_pb2 as pb
from embedserv.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.server import free_port, server_env, stop_process, wait_until_serving

REPO_ROOT = Path(__file__).resolve().parents[1]
KINDS = ("embed", "rerank", "generate")
SERVED_NAMES = {"embed": "minilm", "rerank": "cross-encoder", "generate": "llama"}
CALL_TIMEOUT_S = 300.0
ERROR_BACKOFF_S = 0.1  # a call refused at once (server down, overloaded) would otherwise spin its slot


def build_small_llama(out: Path) -> Path:
    """A random-weight Llama small enough to generate quickly on a CPU, with the bundled tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tokenizer.model_max_length = 2048
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=101, eos_token_id=102,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def model_dirs(kinds: tuple[str, ...], scratch: Path) -> dict[str, Path]:
    """{call kind: model directory}; the random-weight models are built under `scratch` (torch loads here)."""
    from benchmarks.rerank_throughput import build_minilm_cross_encoder

    build = {"embed": bundled_model_path, "rerank": lambda: build_minilm_cross_encoder(scratch / "rerank"),
             "generate": lambda: build_small_llama(scratch / "generate")}  # fmt: skip
    return {kind: build[kind]() for kind in kinds}


class Workload:
    """Each call's arguments, drawn from real texts with the calling slot's seeded random stream."""

    def __init__(self, batch: int):
        self.texts = stdlib_texts(2000, seed=7)
        self.words = " ".join(self.texts).split()
        self.batch = batch

    def arguments(self, kind: str, rng: random.Random) -> dict:
        if kind == "embed":
            return {"texts": rng.choices(self.texts, k=self.batch)}
        if kind == "rerank":
            query = " ".join(rng.choice(self.texts).split()[:8])
            return {"query": query, "documents": rng.choices(self.texts, k=self.batch)}
        length, start = rng.randint(10, 200), rng.randrange(len(self.words) - 200)
        return {"prompt": " ".join(self.words[start : start + length]), "max_tokens": rng.randint(8, 64)}


def expect_count(got: int, asked: int, what: str) -> None:
    if got != asked:
        raise ValueError(f"{got} {what} in the answer, {asked} asked")


@contextlib.asynccontextmanager
async def grpc_calls(target: str):
    """{kind: call} over one grpc.aio channel; a call raises on an error status or a wrong-sized answer."""
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub, names = pb_grpc.InferenceStub(channel), SERVED_NAMES

        async def embed(texts: list[str]) -> None:
            request = pb.EmbedRequest(model=names["embed"], inputs=texts, truncate=True, encoding=pb.ENCODING_BYTES)
            expect_count(len((await stub.Embed(request, timeout=CALL_TIMEOUT_S)).embeddings), len(texts), "embeddings")

        async def rerank(query: str, documents: list[str]) -> None:
            request = pb.RerankRequest(model=names["rerank"], query=query, documents=documents, truncate=True)
            expect_count(len((await stub.Rerank(request, timeout=CALL_TIMEOUT_S)).results), len(documents), "results")

        async def generate(prompt: str, max_tokens: int) -> None:
            request = pb.GenerateRequest(model=names["generate"], prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         ignore_eos=True)  # fmt: skip
            replies = stub.Generate(request, timeout=CALL_TIMEOUT_S)
            expect_count(sum([len(reply.token_ids) async for reply in replies]), max_tokens, "tokens (EOS ignored)")

        yield {"embed": embed, "rerank": rerank, "generate": generate}


@contextlib.asynccontextmanager
async def http_calls(base_url: str):
    """{kind: call} over the OpenAI-compatible and rerank routes; a call raises on a non-200 answer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=CALL_TIMEOUT_S, limits=limits) as client:

        async def post(path: str, kind: str, body: dict) -> dict:
            reply = await client.post(path, json={"model": SERVED_NAMES[kind], **body})
            if reply.status_code != 200:
                raise ValueError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return reply.json()

        async def embed(texts: list[str]) -> None:
            body = {"input": texts, "truncate": True, "encoding_format": "base64"}
            expect_count(len((await post("/v1/embeddings", "embed", body))["data"]), len(texts), "embeddings")

        async def rerank(query: str, documents: list[str]) -> None:
            body = {"query": query, "documents": documents, "truncate": True, "return_documents": False}
            expect_count(len((await post("/v1/rerank", "rerank", body))["results"]), len(documents), "results")

        async def generate(prompt: str, max_tokens: int) -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            generated = (await post("/v1/completions", "generate", body))["usage"]["completion_tokens"]
            if not 1 <= generated <= max_tokens:
                raise ValueError(f"{generated} tokens generated, {max_tokens} at most asked")

        yield {"embed": embed, "rerank": rerank, "generate": generate}


async def run_slot(slot: int, kinds: tuple[str, ...], calls: dict, workload: Workload, tallies: dict) -> None:
    """Keep one call in flight until cancelled, recording each into tallies "interval", `kind` and "total".
    Slots start at different kinds so that a mixed load runs all three at once."""
    rng = random.Random(slot)
    for kind in itertools.islice(itertools.cycle(kinds), slot % len(kinds), None):
        arguments, started = workload.arguments(kind, rng), time.perf_counter()
        try:
            await calls[kind](**arguments)
            seconds, error = time.perf_counter() - started, None
        except Exception as err:
            rpc = isinstance(err, grpc.aio.AioRpcError)
            error = f"{err.code().name}: {err.details()}" if rpc else f"{type(err).__name__}: {err}"
            seconds, error = None, error[:200]
        for key in ("interval", kind, "total"):
            tallies[key].record(seconds, error)
        if error:
            await asyncio.sleep(ERROR_BACKOFF_S)


async def soak(args: argparse.Namespace, target: str, http_port: int, monitor: Monitor, tallies: dict[str, Tally],
               proc: subprocess.Popen) -> None:  # fmt: skip
    """Load from every slot, sampling each --interval, until --minutes pass or the server exits."""
    workload, kinds = Workload(args.batch), tuple(kind for kind in tallies if kind not in ("interval", "total"))
    # Clients are made here: a grpc.aio channel belongs to the event loop running when it is made.
    async with http_calls(f"http://127.0.0.1:{http_port}") if http_port else grpc_calls(target) as calls:
        monitor.sample(0.0)
        start = last = time.monotonic()
        deadline = start + args.minutes * 60
        slots = [asyncio.create_task(run_slot(i, kinds, calls, workload, tallies)) for i in range(args.concurrency)]
        try:
            for tick in itertools.count(1):
                await asyncio.sleep(max(0.0, min(start + tick * args.interval, deadline) - time.monotonic()))
                now, interval, tallies["interval"] = time.monotonic(), tallies["interval"], Tally()
                monitor.sample((now - start) / 60, interval, now - last)
                last = now
                # A server that exited shows in the row just printed: "server gone".
                if now >= deadline or proc.poll() is not None:
                    return
        finally:
            for slot in slots:
                slot.cancel()
            await asyncio.gather(*slots, return_exceptions=True)


@contextlib.contextmanager
def running_server(args: argparse.Namespace, models: dict[str, Path], http_port: int, log: Path):
    """Start `embedserv serve` on the models, wait until it serves, yield (target, process); always stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port",
           str(http_port), "--dtype", args.dtype, "--data-parallel-size", str(args.data_parallel_size)]  # fmt: skip
    for kind, path in models.items():
        cmd += ["--model", str(path), "--served-model-name", SERVED_NAMES[kind]]
    print(f"server: {shlex.join(cmd + args.server_arg)}\nserver log: {log}", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd + args.server_arg, cwd=REPO_ROOT, env=server_env(), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        started = time.monotonic()
        # The HTTP face listens before gRPC does, so gRPC's SERVING covers both.
        wait_until_serving(f"127.0.0.1:{port}", lambda: proc.poll() is None, log, timeout=600)
        print(f"server serving after {time.monotonic() - started:.1f}s (pid {proc.pid})", flush=True)
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_process(proc)


def header() -> dict:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "cpu": cpu_name(),
        "isa": cpu_isa.detect().summary(),
        "cores": os.cpu_count(),
        "commit": commit + changed,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, choices=(*KINDS, "mixed"))
    parser.add_argument("--minutes", type=float, required=True, help="how long the load runs")
    parser.add_argument("--concurrency", type=int, default=8, help="calls in flight at all times")
    parser.add_argument("--batch", type=int, default=32, help="texts per embed call, documents per rerank call")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warm-up-minutes", type=float, default=5.0, help="the RSS slope starts here")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="worker processes per model")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--json", type=Path, default=None, help="write every sample and the summary here")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument to `embedserv serve`")
    args = parser.parse_args()
    if min(args.minutes, args.interval, args.concurrency, args.batch) <= 0:
        parser.error("--minutes, --interval, --concurrency and --batch must be positive")
    return args


def main() -> None:
    args = parse_args()
    info = header()
    print("\n".join(f"{key}: {value}" for key, value in info.items()), flush=True)
    kinds = KINDS if args.load == "mixed" else (args.load,)
    tallies = {key: Tally() for key in ("interval", *kinds, "total")}
    monitor, interrupted = None, False
    log = Path(tempfile.mkdtemp(prefix="embedserv-soak-")) / "server.log"
    http_port = free_port() if args.protocol == "http" else 0
    with tempfile.TemporaryDirectory(prefix="embedserv-soak-models-") as scratch:
        try:
            with running_server(args, model_dirs(kinds, Path(scratch)), http_port, log) as (target, proc):
                monitor = Monitor(proc.pid)
                asyncio.run(soak(args, target, http_port, monitor, tallies, proc))
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: the server is stopped; the summary covers the samples so far", flush=True)
    if monitor is None or not monitor.rows:
        sys.exit(1)
    summary = summarize(monitor.rows, tallies, args.warm_up_minutes)
    if args.json:
        payload = {
            "header": info,
            "args": vars(args),
            "server_log": log,
            "interrupted": interrupted,
            "rows": monitor.rows,
            "summary": summary,
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
