"""Where a server's CPU goes, by stage: py-spy samples of the server's processes during one load pass, each
sample put in the stage of its innermost frame that a rule below names (benchmarks/host_ceiling.py --profile).

Idle samples (threads waiting in epoll, a queue or a lock) are not taken, so the shares are of busy CPU time.
Stages: parse and validate the call, tokenize, queue and schedule, IPC to the worker, the worker's step,
outputs (pooling, normalization, encodings), serialize the response, and the frameworks' own loops (gRPC's
and asyncio's) where no embedserv frame is under them.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# Innermost match wins: (stage, substrings of a frame "function (file:line)").
RULES = (
    ("tokenize", ("engine/inputs/tokenizer.py", "tokenizers/")),
    ("IPC", ("executor/codec.py", "executor/process_worker.py", "multiprocessing/connection.py", "remote_core.py",
             "server/frontends.py")),
    ("queue + schedule", ("scheduler/", "engine/core/dispatch.py", "engine/core/local_core.py")),
    ("outputs", ("engine/tasks/",)),
    ("serialize", ("response", "serialize", "encode_vectors", "tobytes", "b64encode", "json/encoder", "orjson")),
    ("parse + validate", ("server/grpc/", "server/http/", "server/frontend.py", "pydantic", "fastapi", "starlette",
                          "json/decoder", "httptools", "h11")),
    ("gRPC framework", ("grpc/", "grpc_health")),
    ("HTTP framework", ("uvicorn/",)),
    ("asyncio", ("asyncio/",)),
)  # fmt: skip


def stage_of(frames: list[str]) -> str:
    if any("worker_main.py" in frame or "worker/model_runner.py" in frame for frame in frames):
        return "worker step"
    for frame in reversed(frames):
        for stage, needles in RULES:
            if any(needle in frame for needle in needles):
                return stage
    return "other"


def parse_raw(text: str) -> Counter:
    counts: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[stage_of(stack.split(";"))] += int(count)
    return counts


def profile_stages(pid: int, load: Callable[[], object], rate: int = 200) -> dict | None:
    """Samples `pid` and its children while `load()` runs; {stage: busy seconds} plus "_wall" (None without
    py-spy)."""
    spy = shutil.which("py-spy") or str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "py-spy")
    if not Path(spy).exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "raw.txt"
        cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", str(rate),
               "--format", "raw", "--output", str(out)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        start = time.perf_counter()
        load()
        wall = time.perf_counter() - start
        proc.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        proc.wait(timeout=60)
        if not out.exists():
            return None
        counts = parse_raw(out.read_text())
    stages = {stage: count / rate for stage, count in counts.items()}
    stages["_wall"] = wall
    return stages


def render_stages(label: str, stages: dict) -> str:
    wall = stages.pop("_wall")
    busy = sum(stages.values())
    lines = ["", f"{label}: busy CPU by stage, one-text gRPC pass of {wall:.1f} s wall ({busy:.1f} CPU s sampled)", "",
             "| stage | CPU s | share | CPU ms per wall s |", "|---|---|---|---|"]  # fmt: skip
    for stage, seconds in sorted(stages.items(), key=lambda item: -item[1]):
        lines.append(f"| {stage} | {seconds:.2f} | {seconds / busy:.0%} | {seconds / wall * 1000:.0f} |")
    return "\n".join(lines)
