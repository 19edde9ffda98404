"""Generation behind servers: output tokens/s of embedserv (gRPC Generate streams, HTTP /v1/completions) and of
vLLM's CPU OpenAI server (/v1/completions), same model, same prompts, same run; and embedserv's host time per
step.

    python benchmarks/generate_servers.py [--streams 32,128] [--max-tokens 64] [--repeats 3] [--dtype float32]
        [--base /tmp/wt-gen-base] [--vllm-python .peers/vllm/bin/python] [--servers embedserv,base,vllm]

The model is a random-weight Llama with 2 layers, hidden 256 (4 heads, MLP 1024, tied embeddings) and the
bundled tokenizer's 30,522-token vocabulary, built here (nothing downloaded). Each pass sends N requests at
once (one per stream: a real text of 30 to 90 words), greedy, exactly --max-tokens tokens each (EOS ignored),
and times from the first request to the last reply; output tokens/s is the tokens the replies report over
that wall time. HTTP requests are not streamed (the reply's usage counts the tokens); gRPC Generate always
streams. `--base DIR`: a worktree of another commit, served as the row "embedserv base" by this venv's
Python with DIR first on PYTHONPATH, to compare before and after in one run.

Every server starts once and stays up; passes are interleaved (one untimed pass, then --repeats rounds, each
server and protocol once per round) and the fastest counts, so load from others on the machine hits every
row alike (each round starts with the next server, and each pass waits 2 s for the last one's threads to
settle). Host time per step: embedserv's /metrics around each pass give the generation steps run
(embedserv_batch_sequences_count) and the seconds the worker spent running them (model forward, LM head,
sampling and the copy of the tokens: embedserv_worker_busy_seconds); host ms/step = (wall - busy) / steps,
which is everything else per step: scheduling, the message to and from the worker, input building,
detokenizing, delivering the text, and the client's share of the CPU. Server CPU ms/step is the CPU time of
the server's engine process (every thread: protocol, scheduling, detokenizing) over the steps, which other
load on the machine inflates less than wall times. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.generate_throughput import build_model, prompts  # noqa: E402
from benchmarks.peer_runners.servers import free_port, process_group, wait_http  # noqa: E402
from benchmarks.peers import VLLM_SITE, peer_env  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
NAME = "m"
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Served:
    """One running server: where its protocols and (embedserv) its metrics are."""

    label: str
    grpc: str | None  # host:port
    http: str  # base URL
    metrics: str | None  # /metrics URL
    pid: int = 0  # the server's process (embedserv: the engine's, not the worker's)

    @property
    def protocols(self) -> list[str]:
        return (["grpc"] if self.grpc else []) + ["http"]


def embedserv_cmd(python: str, model: str, dtype: str) -> tuple[list[str], Served]:
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [python, "-m", "embedserv", "serve", "--model", model, "--served-model-name", NAME, "--host", "127.0.0.1",
           "--port", str(port), "--http-port", str(http_port), "--metrics-port", str(metrics_port), "--device", "cpu",
           "--dtype", dtype, "--log-level", "warning"]  # fmt: skip
    served = Served(
        "", f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    )
    return cmd, served


def vllm_cmd(python: str, model: str, dtype: str) -> tuple[list[str], Served]:
    """vLLM's OpenAI server through its module (see peer_runners/servers.py: vllm_server), generate runner."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--runner", "generate",
           "--dtype", dtype, "--max-model-len", "2048", "--served-model-name", NAME, "--host", "127.0.0.1",
           "--port", str(port), "--seed", "0"]  # fmt: skip
    return cmd, Served("vLLM server", None, f"http://127.0.0.1:{port}", None)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_metrics(url: str) -> tuple[float, float]:
    """(generation steps so far, worker busy seconds so far) from embedserv's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    steps = re.search(r'^embedserv_batch_sequences_count\{[^}]*kind="generate"[^}]*\} (\S+)', text, re.M)
    busy = re.findall(r"^embedserv_worker_busy_seconds(?:_total)?\{[^}]*\} (\S+)", text, re.M)
    return (float(steps.group(1)) if steps else 0.0), sum(float(b) for b in busy)


async def grpc_pass(target: str, texts: list[str], max_tokens: int) -> int:
    import grpc

    from embedserv.v1 import embedserv_pb2 as pb
    from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(text: str) -> int:
            request = pb.GenerateRequest(model=NAME, prompt=text, max_tokens=max_tokens, ignore_eos=True)
            return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=REQUEST_TIMEOUT_S)])

        return sum(await asyncio.gather(*(one(t) for t in texts)))


async def http_pass(base: str, texts: list[str], max_tokens: int) -> int:
    import httpx

    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=len(texts) + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(text: str) -> int:
            body = {"model": NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            reply = await client.post(f"{base}/v1/completions", json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code} from {base}: {reply.text[:300]}")
            return reply.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(t) for t in texts)))


def one_pass(served: Served, protocol: str, texts: list[str], max_tokens: int) -> dict:
    before = read_metrics(served.metrics) if served.metrics else None
    cpu_before = cpu_seconds(served.pid)
    start = time.perf_counter()
    if protocol == "grpc":
        tokens = asyncio.run(grpc_pass(served.grpc, texts, max_tokens))
    else:
        tokens = asyncio.run(http_pass(served.http, texts, max_tokens))
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "tokens": tokens, "server_cpu_s": cpu_seconds(served.pid) - cpu_before}
    if before is not None:
        steps, busy = (a - b for a, b in zip(read_metrics(served.metrics), before, strict=True))
        result |= {"steps": steps, "busy_s": busy}
    time.sleep(2.0)  # threads spin a while after a pass (OpenMP, vLLM's engine loop): let them rest first
    return result


def start_servers(stack: ExitStack, args, model: str, log_dir: Path) -> list[Served]:
    python = sys.executable
    wanted = args.servers.split(",")
    specs = []
    if "embedserv" in wanted:
        cmd, served = embedserv_cmd(python, model, args.dtype)
        specs.append(
            ("embedserv", cmd, served, peer_env("embedserv", python) | {"PYTHONPATH": str(REPO_ROOT)}, REPO_ROOT)
        )
    if "base" in wanted and args.base:
        cmd, served = embedserv_cmd(python, model, args.dtype)
        base = Path(args.base).resolve()
        specs.append(("embedserv base", cmd, served, peer_env("embedserv", python) | {"PYTHONPATH": str(base)}, base))
    if "vllm" in wanted:
        cmd, served = vllm_cmd(args.vllm_python, model, args.dtype)
        specs.append(("vLLM server", cmd, served, peer_env("vllm", args.vllm_python), REPO_ROOT))
    servers = []
    for label, cmd, served, env, cwd in specs:
        log = log_dir / f"{label.replace(' ', '-')}.log"
        proc = stack.enter_context(process_group(cmd, env, log, cwd))
        wait_http(f"{served.http}/health", proc, log, timeout=600)
        served.label, served.pid = label, proc.pid
        servers.append(served)
        print(f"{label} is up (log {log})", file=sys.stderr, flush=True)
    return servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="32,128")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="every server's --dtype (float32 or bfloat16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", default="", help="a worktree of the commit to compare with")
    parser.add_argument("--vllm-python", default=str(REPO_ROOT / ".peers" / "vllm" / "bin" / "python"))
    parser.add_argument("--servers", default="embedserv,base,vllm")
    parser.add_argument("--logs", default="", help="where the servers' logs go (default: a temporary directory)")
    args = parser.parse_args()
    assert VLLM_SITE.exists()

    results: dict[tuple[str, str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        log_dir = Path(args.logs or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = str(build_model(Path(tmp) / "llama", SHAPE))
        servers = start_servers(stack, args, model, log_dir)
        for streams in [int(s) for s in args.streams.split(",")]:
            texts = prompts(streams)
            for round_ in range(args.repeats + 1):
                # Each round starts with another server, so that no row always follows the same one.
                for served in servers[round_ % len(servers) :] + servers[: round_ % len(servers)]:
                    for protocol in served.protocols:
                        result = one_pass(served, protocol, texts, args.max_tokens)
                        if round_:  # round 0 warms up
                            results.setdefault((served.label, protocol, streams), []).append(result)
                print(f"done x{streams} round {round_}", file=sys.stderr, flush=True)
    print_table(results, args)


def print_table(results: dict, args) -> None:
    rounds = f"best of {args.repeats} interleaved rounds"
    print(f"\n{args.dtype}, {args.max_tokens} tokens per stream, greedy, EOS ignored; {rounds}\n")
    print("| server | protocol | streams | output tok/s | vs vLLM | tokens | steps | model ms/step | host ms/step "
          "| server CPU ms/step |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    vllm = {
        s: max(r["tokens"] / r["wall_s"] for r in rs) for (label, _, s), rs in results.items() if label == "vLLM server"
    }
    for (label, protocol, streams), runs in results.items():
        best = max(runs, key=lambda r: r["tokens"] / r["wall_s"])
        rate = best["tokens"] / best["wall_s"]
        versus = f"{rate / vllm[streams]:.2f}x" if streams in vllm else "-"
        steps, busy = best.get("steps"), best.get("busy_s")
        model = f"{busy / steps * 1e3:.2f}" if steps else "-"
        host = f"{(best['wall_s'] - busy) / steps * 1e3:.2f}" if steps else "-"
        cpu = f"{min(r['server_cpu_s'] / r['steps'] for r in runs) * 1e3:.2f}" if steps else "-"
        name = "HTTP /v1/completions" if protocol == "http" else "gRPC Generate"
        print(f"| {label} | {name} | {streams} | {rate:,.0f} | {versus} | {best['tokens']} | {steps or '-'} "
              f"| {model} | {host} | {cpu} |")  # fmt: skip


if __name__ == "__main__":
    main()
