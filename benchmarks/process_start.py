"""A server's processes: how long it takes to serve, what a worker's replacement takes, what they hold in memory.

    python benchmarks/process_start.py [--base DIR] [--repeats 3] [--data-parallel-size 2] [--frontends 2]

Each pass starts `embedserv serve` of the bundled MiniLM (`--no-warm-up`) from this checkout, and from DIR (a
checkout of another commit, say a worktree of the base) when given, the two alternating, and measures:
- the seconds until health says SERVING, and the machine's CPU-seconds meanwhile (/proc/stat, so run it on a quiet
  machine: other processes count too);
- the summed PSS of the server's processes once serving (shared pages split among their sharers);
- a worker SIGKILLed: the seconds until its successor's log says it is ready, and the CPU-seconds meanwhile.
Prints a table (the best pass of each, and the median) and saves it with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.helpers.processes import child_pids, wait_for, worker_pids  # noqa: E402
from tests.helpers.server import free_port, server_env, stop_process, wait_until_serving  # noqa: E402


def busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def one_pass(checkout: Path, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "embedserv", "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port",
           "0", "--no-warm-up", "--data-parallel-size", str(args.data_parallel_size), "--frontends",
           str(args.frontends)]  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="embedserv-process-start-")) / "server.log"
    cpu, started = busy_seconds(), time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=checkout, env=server_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(f"127.0.0.1:{port}", lambda: proc.poll() is None, log, timeout=600)
        row = {"serving_s": time.monotonic() - started, "serving_cpu_s": busy_seconds() - cpu}
        time.sleep(1.0)  # whatever the start left running settles
        row["pss_mib"] = sum(pss_mib(pid) for pid in [proc.pid, *child_pids(proc.pid)])
        victim = worker_pids(proc.pid)[0]
        readies = log.read_text().count("ready on cpu")
        cpu, started = busy_seconds(), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: log.read_text().count("ready on cpu") > readies, 300, interval=0.02, what="a successor")
        row |= {"replace_s": time.monotonic() - started, "replace_cpu_s": busy_seconds() - cpu}
    finally:
        stop_process(proc)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of another commit, run alternately with this one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--json", type=Path, help="save the passes and the table here")
    args = parser.parse_args()
    sides = {"this checkout": REPO_ROOT, **({"base": args.base} if args.base else {})}
    passes: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, checkout in sides.items():
            passes[name].append(one_pass(checkout, args))
            print(name, {k: round(v, 2) for k, v in passes[name][-1].items()}, flush=True)
    keys = ["serving_s", "serving_cpu_s", "pss_mib", "replace_s", "replace_cpu_s"]
    print(f"\n--data-parallel-size {args.data_parallel_size} --frontends {args.frontends}, {args.repeats} passes: "
          "best (median)")  # fmt: skip
    print("| checkout | " + " | ".join(keys) + " |\n|---|" + "---:|" * len(keys))
    table = {}
    for name, rows in passes.items():
        table[name] = {k: (min(r[k] for r in rows), statistics.median(r[k] for r in rows)) for k in keys}
        print(f"| {name} | " + " | ".join(f"{best:.2f} ({median:.2f})" for best, median in table[name].values()) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": sys.argv[1:], "passes": passes, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
