"""The path of one one-text Embed call: which of the project's files and functions run, in each server process.

    python benchmarks/call_path.py [--frontends N] [--checkout DIR] [--calls 5] [--list] [--json OUT]

Starts `embedserv serve` on the bundled all-MiniLM-L6-v2 with default flags (plus `--frontends N` when given)
from this checkout or another one (`--checkout`, e.g. a worktree of a base commit), with a recorder in every
Python process it starts (benchmarks/call_path_hook/sitecustomize.py: a profile function that notes each
function of that checkout's embedserv/ called between SIGUSR1 and SIGUSR2). After warm-up calls, each measured
call is one gRPC Embed of one text: every server process (server, front ends, workers) is switched on, the
call is made, and every process is switched off and writes what ran. A function counts when it ran in every
measured call (the intersection), so background work that happens to fall in one window (a supervisor's
poll, a status broadcast) is left out; list comprehensions and generator expressions are not counted apart
from the function they are in.

Prints files and functions per process role and in all (the union over processes), and with --list every
function by file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.peer_runners.servers import free_port, process_group, wait_http  # noqa: E402
from embedserv.executor import zygote  # noqa: E402

HOOK_DIR = Path(__file__).resolve().parent / "call_path_hook"
_ORDER = ["server", "front end", "engine host", "worker"]
_EXPRESSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<module>")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (worker processes start sessions of their own, so walk /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children[int(fields[1])].append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def role(record: dict, server_pid: int, frontends: int | None) -> str:
    """server (one process), or engine host and front end (--frontends N above 1), or worker."""
    if record["pid"] == server_pid:
        return "engine host" if (frontends or 1) > 1 else "server"
    if record.get("name") == zygote.FRONTEND_NAME:  # forked by the zygote, with its argv (executor/zygote.py)
        return "front end"
    return "worker" if "worker_main" in " ".join(record["argv"]) else "front end"


def _wait_for(out_dir: Path, pattern: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(list(out_dir.glob(pattern))) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(list(out_dir.glob(pattern)))} of {count} processes answered")
        time.sleep(0.001)


def measure_once(stub, pb, pids: list[int], out_dir: Path, text: str) -> dict[int, dict]:
    for path in out_dir.iterdir():
        path.unlink()
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    _wait_for(out_dir, "*.on", len(pids))  # every process records: the window opens as the call starts
    stub.Embed(pb.EmbedRequest(inputs=[text]), timeout=60)
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    _wait_for(out_dir, "*.json", len(pids))
    return {int(p.stem): json.loads(p.read_text()) for p in out_dir.glob("*.json")}


def run(checkout: Path, frontends: int | None, calls: int) -> dict[str, set[tuple[str, str]]]:
    """Per role: the (file, function) pairs that ran in every measured call."""
    import grpc

    from embedserv.config import bundled_model_path
    from embedserv.v1 import embedserv_pb2 as pb
    from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

    root = checkout / "embedserv"
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "embedserv", "serve", "--model", str(bundled_model_path()), "--host", "127.0.0.1",
           "--port", str(port), "--http-port", str(http_port), "--log-level", "warning"]  # fmt: skip
    if frontends is not None:
        cmd += ["--frontends", str(frontends)]
    scratch = Path(tempfile.mkdtemp(prefix="call-path-"))
    out_dir = scratch / "records"
    out_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOK_DIR), str(checkout)]),
               EMBEDSERV_CALL_PATH_DIR=str(out_dir), EMBEDSERV_CALL_PATH_ROOT=str(root) + os.sep,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
    per_call: list[dict[str, set]] = []
    with process_group(cmd, env, scratch / "server.log", checkout) as proc:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, scratch / "server.log", timeout=600)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.InferenceStub(channel)
        for i in range(20):
            stub.Embed(pb.EmbedRequest(inputs=[f"warm-up call {i}: a sentence to embed"]), timeout=60)
        pids = descendants(proc.pid)
        for i in range(calls):
            records = measure_once(stub, pb, pids, out_dir, f"measured call {i}: a sentence to embed")
            roles: dict[str, set] = defaultdict(set)
            for record in records.values():
                where = role(record, proc.pid, frontends)
                for filename, _, qualname in record["functions"]:
                    if not qualname.endswith(_EXPRESSIONS):
                        roles[where].add((str(Path(filename).relative_to(checkout)), qualname))
            per_call.append(roles)
        channel.close()
    names = set().union(*per_call)
    return {name: set.intersection(*(call.get(name, set()) for call in per_call)) for name in names}


def render(label: str, roles: dict[str, set[tuple[str, str]]], listing: bool) -> str:
    union = set().union(*roles.values())
    lines = [f"## {label}", "", "| process | files | functions |", "|---|---:|---:|"]
    for name in sorted(roles, key=_ORDER.index):
        pairs = roles[name]
        lines.append(f"| {name} | {len({f for f, _ in pairs})} | {len(pairs)} |")
    lines.append(f"| **all (union)** | **{len({f for f, _ in union})}** | **{len(union)}** |")
    if listing:
        for name in sorted(roles, key=_ORDER.index):
            by_file: dict[str, list[str]] = defaultdict(list)
            for filename, qualname in roles[name]:
                by_file[filename].append(qualname)
            lines += ["", f"### {name}: {len(by_file)} files, {len(roles[name])} functions", ""]
            lines += [f"- `{f}` ({len(q)}): {', '.join(sorted(q))}" for f, q in sorted(by_file.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontends", type=int, default=None, help="serve with --frontends N (default: no flag)")
    parser.add_argument("--checkout", default=str(REPO_ROOT), help="the checkout whose server runs")
    parser.add_argument("--calls", type=int, default=5, help="measured calls (a function counts if it ran in all)")
    parser.add_argument("--list", action="store_true", help="every function, by process and file")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    checkout = Path(args.checkout).resolve()
    roles = run(checkout, args.frontends, args.calls)
    flags = "default flags" if args.frontends is None else f"--frontends {args.frontends}"
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(render(f"{checkout.name} at {commit}, {flags}", roles, args.list))
    if args.json:
        Path(args.json).write_text(json.dumps({k: sorted(v) for k, v in roles.items()}, indent=1))


if __name__ == "__main__":
    main()
