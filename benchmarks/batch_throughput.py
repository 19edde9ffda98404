"""`embedserv batch` against the in-process engine's best and a client loop against `embedserv serve` (issue 52).

    python benchmarks/batch_throughput.py [--texts 20000] [--chars 200] [--passes 2] [--json PATH]

Same texts for every system (`--texts` stdlib docstrings cut to `--chars` characters), the bundled MiniLM,
float32 on the CPU, in one run:
- engine best: SyncEngine.embed_concurrently, every text submitted at once in calls of 64 (no I/O at all);
- embedserv batch: the command in its own process, JSONL in, Parquet out; rows/s is from its final log line
  (after the model loaded), and the command's whole wall time is shown too;
- client loop: `embedserv serve` in its own process and one embedserv-client loop, one call after another, of 32
  texts a call (sentence-transformers' default batch) and of 64.
Best of `--passes` for each; texts/s and the ratios to the engine's best.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv.config import ModelConfig  # noqa: E402
from embedserv.engine.sync import SyncEngine  # noqa: E402
from embedserv.types import EmbedParams  # noqa: E402
from embedserv_client import Client  # noqa: E402
from tests.helpers.models import bundled_model_dir  # noqa: E402
from tests.helpers.server import running_server  # noqa: E402

CALL = 64
LOOP_CALLS = (32, 64)
_DONE = re.compile(r"done: ([\d,]+) .*? rows, ([\d,]+) rows/s")


def engine_best(texts: list[str]) -> float:
    config = ModelConfig(path=str(bundled_model_dir()), served_name="m", dtype="float32")
    with SyncEngine(config) as engine:
        calls = [texts[i : i + CALL] for i in range(0, len(texts), CALL)]
        engine.embed_concurrently(calls[:4], EmbedParams(truncate=True))  # warm
        start = time.perf_counter()
        engine.embed_concurrently(calls, EmbedParams(truncate=True))
        return len(texts) / (time.perf_counter() - start)


def batch_command(texts: list[str], work: Path) -> tuple[float, float]:
    """(rows/s after the model loaded, rows/s over the command's whole wall time)."""
    source = work / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = work / f"out-{time.monotonic_ns()}"
    command = [
        sys.executable, "-m", "embedserv", "batch", "--dtype", "float32", "--input", str(source),
        "--output", str(out), "--truncate", "--no-progress",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    match = _DONE.search(done.stderr)
    if match is None:
        raise RuntimeError(f"no final progress line in: {done.stderr[-2000:]}")
    return float(match.group(2).replace(",", "")), len(texts) / wall


def client_loops(texts: list[str]) -> dict[str, float]:
    """A user's loop: one call after another, LOOP_CALLS texts each (32: sentence-transformers' default batch)."""
    rates = {}
    with running_server(["--dtype", "float32", "--device", "cpu", "--log-level", "warning"]) as (target, _):
        with Client(target, timeout=600) as client:
            client.embed(texts[:CALL], truncate=True)  # warm
            for size in LOOP_CALLS:
                start = time.perf_counter()
                for i in range(0, len(texts), size):
                    client.embed(texts[i : i + size], truncate=True)
                rates[f"client loop, {size} a call"] = len(texts) / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=20_000)
    parser.add_argument("--chars", type=int, default=200)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    texts = [t[: args.chars] for t in stdlib_texts(args.texts, seed=9)]
    rows: dict[str, list[float]] = {
        "engine best": [],
        "embedserv batch": [],
        "batch, whole wall time": [],
    }
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.passes):  # systems take turns: drift hits each alike
            rows["engine best"].append(engine_best(texts))
            after_load, whole = batch_command(texts, Path(work))
            rows["embedserv batch"].append(after_load)
            rows["batch, whole wall time"].append(whole)
            for name, rate in client_loops(texts).items():
                rows.setdefault(name, []).append(rate)
    best = {name: max(values) for name, values in rows.items()}
    print(f"{args.texts} texts of at most {args.chars} characters, bundled MiniLM, float32, {platform.processor()}")
    print(f"{'system':28} {'texts/s':>9} {'vs engine best':>15}")
    for name, value in best.items():
        print(f"{name:28} {value:9.0f} {value / best['engine best']:14.2f}x")
    for size in LOOP_CALLS:
        ratio = best["embedserv batch"] / best[f"client loop, {size} a call"]
        print(f"embedserv batch vs the client loop of {size} a call: {ratio:.2f}x")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
        record = {"command": " ".join(sys.argv), "commit": commit.stdout.strip(), "date": time.strftime("%Y-%m-%d"),
                  "passes": rows, "best": best}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
