"""What a soak records and prints (benchmarks/soak.py runs the load): each kind's calls, each process's RSS, open
files and threads per interval, the interval table, and the summary with each process's RSS slope.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from tests.helpers.processes import child_pids, cmdline, role

MAX_DISTINCT_ERRORS = 50  # messages that carry ids would grow a counter without bound over a long soak


@dataclass
class Tally:
    """Finished calls: the answered ones' latencies (seconds) and the failed ones' messages."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def record(self, seconds: float | None, error: str | None) -> None:
        if error is None:
            self.latencies.append(seconds)
        else:
            self.errors[error if error in self.errors or len(self.errors) < MAX_DISTINCT_ERRORS else "(others)"] += 1

    def percentile_ms(self, q: float) -> float | None:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3 if ordered else None


def sample_processes(server_pid: int) -> dict[str, dict]:
    """{label: {pid, rss_mib, fds, threads}} of the server and its live children (a worker: its WorkerArgs name)."""
    samples: dict[str, dict] = {}
    for pid in [server_pid, *child_pids(server_pid)]:
        argv, label = cmdline(pid), "server" if pid == server_pid else f"{role(pid)} {pid}"
        with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
            label = json.loads(argv[argv.index("embedserv.executor.worker_main") + 1])["name"]
        with contextlib.suppress(OSError, ValueError, KeyError):  # gone, or a zombie (no VmRSS), since listed
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            samples[label if label not in samples else f"{label} (pid {pid})"] = {
                "pid": pid, "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
                "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"]),
            }  # fmt: skip
    return samples


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_row(cells: list[str], head: bool = False) -> str:
    row = "| " + " | ".join(cells) + " |"
    return row + "\n|---" + "|---:" * (len(cells) - 1) + "|" if head else row


class Monitor:
    """Samples the server's processes and prints one markdown row per sample; notes restarts."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.rows: list[dict] = []
        self.columns: list[str] = []  # the labels of the first sample's processes
        self.pids: dict[str, int] = {}  # each label's last pid, a gone process's too: a new pid is a restart

    def sample(self, minute: float, tally: Tally | None = None, seconds: float = 0.0) -> None:
        """Append and print a row {minute, processes, calls, errors, calls_per_s, p50_ms, p99_ms, notes}."""
        processes = sample_processes(self.server_pid)
        row = {
            "minute": minute,
            "processes": processes,
            "calls": None,
            "errors": None,
            "calls_per_s": None,
            "p50_ms": None,
            "p99_ms": None,
            "notes": [],
        }
        if tally is not None:
            row.update(
                calls=len(tally.latencies),
                errors=sum(tally.errors.values()),
                p50_ms=tally.percentile_ms(0.5),
                calls_per_s=len(tally.latencies) / seconds,
                p99_ms=tally.percentile_ms(0.99),
            )
            row["notes"] += [f"{count}x {message}" for message, count in tally.errors.most_common(3)]
        row["notes"] += [
            f"{label} restarted (pid {self.pids[label]} -> {sample['pid']})"
            for label, sample in processes.items()
            if self.pids.get(label, sample["pid"]) != sample["pid"]
        ]
        row["notes"] += [f"{label} gone (pid {pid})" for label, pid in self.pids.items() if label not in processes]
        self.pids.update({label: sample["pid"] for label, sample in processes.items()})
        if not self.columns:
            self.columns = list(processes)
            each = " / ".join(self.columns)
            print("\n" + markdown_row(["minute", *(f"RSS MiB {label}" for label in self.columns), f"fds ({each})",
                                       f"threads ({each})", "calls", "errors", "calls/s", "p50 ms", "p99 ms", "notes"],
                                      head=True))  # fmt: skip
        self.rows.append(row)
        samples = [processes.get(label) for label in self.columns]
        print(markdown_row([
            f"{minute:.2f}", *(fmt(s and s["rss_mib"]) for s in samples),
            "/".join(str(s["fds"]) if s else "-" for s in samples),
            "/".join(str(s["threads"]) if s else "-" for s in samples), fmt(row["calls"], 0), fmt(row["errors"], 0),
            fmt(row["calls_per_s"]), fmt(row["p50_ms"]), fmt(row["p99_ms"]), "; ".join(row["notes"]),
        ]), flush=True)  # fmt: skip


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (minute, MiB) points; None without two distinct minutes."""
    with contextlib.suppress(statistics.StatisticsError):
        return statistics.linear_regression([x for x, _ in points], [y for _, y in points]).slope
    return None


def summarize(rows: list[dict], tallies: dict[str, Tally], warm_up_minutes: float) -> dict:
    """Per process its RSS from the warm-up's end on; per call kind the totals. Printed as two tables."""
    print(f"\nRSS from the warm-up's end on (the samples at or after minute {warm_up_minutes:g})\n\n" + markdown_row(
        ["process", "pids", "warm-up end minute", "RSS MiB then", "RSS MiB at end", "peak MiB", "slope MiB/minute"],
        head=True))  # fmt: skip
    processes, kinds = {}, {}
    for label in dict.fromkeys(label for row in rows for label in row["processes"]):
        series = [(row["minute"], row["processes"][label]) for row in rows if label in row["processes"]]
        after = [(minute, sample["rss_mib"]) for minute, sample in series if minute >= warm_up_minutes]
        first = after[0] if after else (None, None)
        p = processes[label] = {
            "pids": list(dict.fromkeys(sample["pid"] for _, sample in series)),
            "warm_up_end_minute": first[0],
            "rss_mib_at_warm_up_end": first[1],
            "rss_mib_at_end": series[-1][1]["rss_mib"],
            "rss_mib_peak": max(sample["rss_mib"] for _, sample in series),
            "slope_mib_per_minute": slope_per_minute(after),
        }
        print(markdown_row([label, ", ".join(map(str, p["pids"])), fmt(p["warm_up_end_minute"], 2),
                            fmt(p["rss_mib_at_warm_up_end"]), fmt(p["rss_mib_at_end"]), fmt(p["rss_mib_peak"]),
                            fmt(p["slope_mib_per_minute"], 3)]))  # fmt: skip
    print("\n" + markdown_row(["calls", "answered", "errors", "p50 ms", "p99 ms"], head=True))
    for kind, t in [(kind, tally) for kind, tally in tallies.items() if kind != "interval"]:
        k = kinds[kind] = {
            "calls": len(t.latencies),
            "errors": sum(t.errors.values()),
            "p50_ms": t.percentile_ms(0.5),
            "p99_ms": t.percentile_ms(0.99),
            "error_messages": dict(t.errors.most_common()),
        }
        print(markdown_row([kind, str(k["calls"]), str(k["errors"]), fmt(k["p50_ms"]), fmt(k["p99_ms"])]))
    for message, count in tallies["total"].errors.most_common(5):
        print(f"error, {count}x: {message}")
    return {"processes": processes, "kinds": kinds}
