"""The host ceiling: how many calls a server answers when the model costs nearly nothing.

    python benchmarks/host_ceiling.py [--frontends 1,2] [--texts 3000] [--repeats 3] [--rounds 1] [--base DIR]
                                      [--no-vllm] [--profile]

The model is a random one-layer, 64-wide BERT with the bundled tokenizer (benchmarks/peer_models.py
"host-tiny", mean pooling), so what a call costs is parsing, tokenization, scheduling, IPC to the worker,
pooling and serialization. Every server runs it on this machine beside the load generator
(benchmarks/host_load.py, this process), over gRPC and HTTP (OpenAI /v1/embeddings, base64):
- one text per call, 64 calls in flight: texts/s, and p50 / p99 of the calls' wall times under that load;
- 32 texts per call, 8 calls in flight: texts/s.
Rows: embedserv with each `--frontends N`; with `--base DIR` another checkout (a worktree of the base commit)
with each `--frontends N` too, each base row right after this checkout's row of the same count, and a table of
this checkout's texts/s over the base's; vLLM's CPU OpenAI server from the peer harness's venv (.peers/vllm;
HTTP only), with the peer harness's environment. Each server is started afresh, warmed, then measured best of
--repeats; `--rounds N` runs the whole list N times and keeps each row's best, so drift on a shared machine
falls on every server alike.

gRPC rows add the server's own Timing per call (tokenization, queue, inference, total; means) against the
client's wall time: the rest is transport, parsing and serialization. `--profile` samples the embedserv
servers with py-spy (if installed) during one extra one-text gRPC pass and prints where their CPU goes by stage.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.host_load import LoadResult, cpu_by_role, measure, per_call  # noqa: E402
from benchmarks.host_profile import profile_stages, render_stages  # noqa: E402
from benchmarks.peer_models import model_dir  # noqa: E402
from benchmarks.peer_runners.common import cpu_info  # noqa: E402
from benchmarks.peer_runners.report import isa_summary  # noqa: E402
from benchmarks.peer_runners.servers import free_port, process_group, vllm_server, wait_http  # noqa: E402
from benchmarks.peers import peer_env  # noqa: E402

NAME = "host-tiny"
VLLM_PYTHON = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
LOADS = (("1 text", 1, 64), ("32 texts", 32, 8))


def embedserv_cmd(checkout: Path, model: Path, frontends: int | None) -> tuple[list[str], dict]:
    port, http_port = free_port(), free_port()
    python = str(REPO_ROOT / ".venv" / "bin" / "python")
    cmd = [python, "-m", "embedserv", "serve", "--model", str(model), "--served-model-name", NAME,
           "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port), "--device", "cpu",
           "--max-client-batch-size", "256", "--log-level", "warning"]  # fmt: skip
    if frontends is not None:
        cmd += ["--frontends", str(frontends)]
    http = f"http://127.0.0.1:{http_port}"
    targets = {
        "grpc": {"protocol": "grpc", "url": f"127.0.0.1:{port}"},
        "http": {"protocol": "http", "url": f"{http}/v1/embeddings", "model": NAME, "extra": {"truncate": True}},
    }
    return cmd, {"health": f"{http}/health", "targets": targets, "cwd": checkout}


def vllm_cmd(model: Path) -> tuple[list[str], dict]:
    python = str(VLLM_PYTHON)
    server = vllm_server(python, str(model), NAME, "fp32", 128)
    target = {"protocol": "http", "url": server.url, "model": NAME, "extra": dict(server.extra_body)}
    return server.cmd, {"health": server.health_url, "targets": {"http": target}, "cwd": REPO_ROOT, "env": python}


def run_server(label: str, cmd: list[str], spec: dict, texts: list[str], args, log_dir: Path) -> dict:
    env = peer_env("vllm" if "env" in spec else "embedserv", spec.get("env", sys.executable))
    log = log_dir / f"{label.replace(' ', '_').replace('/', '_')}.log"
    rows = {}
    with process_group(cmd, env, log, Path(spec["cwd"])) as proc:
        started = wait_http(spec["health"], proc, log, timeout=300)
        print(f"  {label}: up in {started:.1f} s", file=sys.stderr)
        for protocol, target in spec["targets"].items():
            for load, size, concurrency in LOADS:
                batches = [texts[i : i + size] for i in range(0, len(texts), size)]
                before = cpu_by_role(proc.pid)
                result = asyncio.run(measure(target, batches, concurrency, args.repeats))
                result.cpu_ms_per_call = per_call(before, cpu_by_role(proc.pid), result.num_calls)
                rows[(protocol, load)] = result
                print(f"  {label} {protocol} {load}: {result.texts_per_s:,.0f} texts/s", file=sys.stderr)
        if args.profile and "grpc" in spec["targets"]:
            batches = [[t] for t in texts]
            rows["stages"] = profile_stages(
                proc.pid, lambda: asyncio.run(measure(spec["targets"]["grpc"], batches, 64, 1))
            )
    return rows


def best_rows(old: dict, new: dict) -> dict:
    """Each (protocol, load) row at its best texts/s over the rounds so far."""
    return {key: max((r for r in (old.get(key), row) if r is not None), key=lambda r: r.texts_per_s)
            if isinstance(row, LoadResult) else row for key, row in new.items()}  # fmt: skip


def render_ratios(results: dict[str, dict]) -> str:
    """This checkout's texts/s over the base's, per front-end count, protocol and load."""
    lines = ["", "This checkout's texts/s over the base's", "", "| --frontends | protocol | load | ratio |",
             "|---|---|---|---|"]  # fmt: skip
    for label, rows in results.items():
        if not label.startswith("embedserv --frontends "):
            continue
        count = label.rsplit(" ", 1)[1]
        base = next((r for name, r in results.items() if name.startswith("base ") and name.endswith(f" {count}")), None)
        for key, row in rows.items():
            if isinstance(row, LoadResult) and base is not None and key in base:
                lines.append(f"| {count} | {key[0]} | {key[1]} | {row.texts_per_s / base[key].texts_per_s:.3f} |")
    return "\n".join(lines)


def render(results: dict[str, dict]) -> str:
    lines = ["| server | protocol | 1 text/call, 64 in flight: texts/s | p50 ms | p99 ms | 32 texts/call, 8 in flight: "
             "texts/s | client CPU s per 1k calls (1 text) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, rows in results.items():
        for protocol in ("grpc", "http"):
            one: LoadResult | None = rows.get((protocol, "1 text"))
            many: LoadResult | None = rows.get((protocol, "32 texts"))
            if one is None:
                continue
            per_1k = one.client_cpu_s / len(one.latencies) * 1000
            lines.append(f"| {label} | {protocol} | {one.texts_per_s:,.0f} | {one.percentile_ms(50):.1f} | "
                         f"{one.percentile_ms(99):.1f} | {many.texts_per_s:,.0f} | {per_1k:.2f} |")  # fmt: skip
    timing = [
        "",
        "gRPC, 1 text per call: the server's Timing against the client's wall time (means, ms)",
        "",
        "| server | client wall | server total | tokenization | queue | inference |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in results.items():
        one = rows.get(("grpc", "1 text"))
        if one is not None and one.timing_us:
            n = len(one.latencies)
            t = {k: v / n / 1e3 for k, v in one.timing_us.items()}
            wall = sum(one.latencies) / n * 1e3
            timing.append(f"| {label} | {wall:.2f} | {t['total']:.2f} | {t['tokenization']:.2f} | {t['queue']:.2f} | "
                          f"{t['inference']:.2f} |")  # fmt: skip
    roles = [
        "",
        "1 text per call: server CPU ms per call by process (all passes, warm-up included)",
        "",
        "| server | protocol | engine / server process | front ends | workers | all |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in results.items():
        for protocol in ("grpc", "http"):
            one = rows.get((protocol, "1 text"))
            if one is not None and one.cpu_ms_per_call:
                c = one.cpu_ms_per_call
                roles.append(f"| {label} | {protocol} | {c.get('server', 0):.3f} | {c.get('front end', 0):.3f} | "
                             f"{c.get('worker', 0):.3f} | {sum(c.values()):.3f} |")  # fmt: skip
    stages = [render_stages(label, rows["stages"]) for label, rows in results.items() if rows.get("stages")]
    return "\n".join(lines + timing + roles + stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", default="1,2", help="embedserv rows, one per front-end count")
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", default=None, help="another checkout, run beside each --frontends row")
    parser.add_argument("--rounds", type=int, default=1, help="run every server this many times; keep the best")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy the embedserv servers: CPU per stage")
    parser.add_argument("--models", default=str(REPO_ROOT / ".peers" / "models"))
    args = parser.parse_args()

    model = model_dir(NAME, Path(args.models))
    texts = stdlib_texts(args.texts)
    servers: list[tuple[str, list[str], dict]] = []
    for count in [int(n) for n in args.frontends.split(",") if n]:
        cmd, spec = embedserv_cmd(REPO_ROOT, model, count)
        servers.append((f"embedserv --frontends {count}", cmd, spec))
        if args.base:
            cmd, spec = embedserv_cmd(Path(args.base), model, count)
            servers.append((f"base {Path(args.base).name} --frontends {count}", cmd, spec))
    if not args.no_vllm and VLLM_PYTHON.exists():
        servers.append(("vLLM CPU server", *vllm_cmd(model)))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as logs:
        for _ in range(args.rounds):
            for label, cmd, spec in servers:
                rows = run_server(label, cmd, spec, texts, args, Path(logs))
                results[label] = best_rows(results.get(label, {}), rows)
    brand, flags = cpu_info()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    print(f"\n{brand} ({isa_summary(flags)}), {platform.node()}, commit {commit.stdout.strip()}, "
          f"{time.strftime('%Y-%m-%d')}; {len(texts)} texts, best of {args.repeats}\n")  # fmt: skip
    print(render(results))
    if args.base:
        print(render_ratios(results))


if __name__ == "__main__":
    main()
