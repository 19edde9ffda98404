"""The reliability section of docs/PERFORMANCE.md (benchmarks/performance_page.py writes the page): the newest
chaos run (benchmarks/chaos.py) and every soak (benchmarks/soak.py) saved under benchmarks/results/chaos/ and
benchmarks/results/soak/: calls by outcome, and each process's memory, files and threads over the soak.

A chaos results file whose name says `before` records a run before a fix; the page shows the newest other one.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OUTCOMES = ("ok", "retryable", "overloaded", "wrong")
# Soak rows shown: these minutes (the run samples every minute; the results file has them all).
SOAK_MINUTES = (0, 1, 5, 10, 15, 20, 25, 30, 45, 60)


def _load(directory: Path) -> list[tuple[str, dict]]:
    return [(path.stem, json.loads(path.read_text())) for path in sorted(directory.glob("*.json"))]


def chaos_lines(directory: Path = RESULTS / "chaos") -> list[str]:
    runs = [(stem, run) for stem, run in _load(directory) if "before" not in stem]
    if not runs:
        return []
    stem, run = max(runs, key=lambda item: item[1]["date"])
    phases: dict[str, dict[str, int]] = {}
    for row in run["table"]:
        counts = phases.setdefault(row["phase"], dict.fromkeys(OUTCOMES, 0))
        for outcome in OUTCOMES:
            counts[outcome] += row[outcome]
    kills = [event["event"] for event in run["events"]]
    lines = [
        "### Chaos: processes killed under mixed load",
        "",
        f"`{run['command']}` ({run['date']}, commit {run['commit']}; {run['cpu']}, {run['cores']} cores). "
        f"Events: {', '.join(kills)}. Server exit code after the drain: {run['exit_code']}. Calls by the last "
        "event before they started:",
        "",
        "| phase | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---:|" * len(OUTCOMES),
    ]
    for phase, counts in phases.items():
        lines.append(f"| {phase} | " + " | ".join(f"{counts[o]:,}" for o in OUTCOMES) + " |")
    totals = {o: sum(counts[o] for counts in phases.values()) for o in OUTCOMES}
    lines += ["| all | " + " | ".join(f"**{totals[o]:,}**" for o in OUTCOMES) + " |", ""]
    lines += [f"From `benchmarks/results/chaos/{stem}.json` (every call's reason is in it).", ""]
    return lines


def _soak_lines(stem: str, run: dict) -> list[str]:
    header, summary = run["header"], run["summary"]
    names = list(run["rows"][0]["processes"])
    rows = [row for row in run["rows"] if any(abs(row["minute"] - m) < 0.01 for m in SOAK_MINUTES)]
    lines = [
        f"`{header['command']}` ({header['date']}, commit {header['commit']}; {header['cpu']}, {header['cores']} "
        "cores). RSS in MiB per process (pid N: a front end, or multiprocessing's helper), open files and threads "
        "summed over them:",
        "",
        "| minute | " + " | ".join(names) + " | files | threads | calls | errors |",
        "|---:|" + "---:|" * (len(names) + 4),
    ]
    for row in rows:
        procs = row["processes"]
        rss = " | ".join(f"{procs[n]['rss_mib']:.0f}" if n in procs else "-" for n in names)
        files = sum(p["fds"] for p in procs.values())
        threads = sum(p["threads"] for p in procs.values())
        calls, errors = row.get("calls"), row.get("errors")
        lines.append(
            f"| {row['minute']:.0f} | {rss} | {files} | {threads} | {calls if calls is not None else '-'} | "
            f"{errors if errors is not None else '-'} |"
        )
    slopes = ", ".join(
        f"{name} {process['slope_mib_per_minute']:.2f}" for name, process in summary["processes"].items()
    )
    lines += ["", f"RSS slope after the warm-up, MiB/minute: {slopes}.", ""]
    lines += [f"From `benchmarks/results/soak/{stem}.json`.", ""]
    return lines


def soak_lines(directory: Path = RESULTS / "soak") -> list[str]:
    lines: list[str] = []
    for stem, run in sorted(_load(directory), key=lambda item: item[1]["header"]["date"], reverse=True):
        lines += [f"### Soak: {run['args']['minutes']:.0f} minutes, {run['args']['load']} load over "
                  f"{run['args']['protocol']}", ""]  # fmt: skip
        lines += _soak_lines(stem, run)
    return lines


def section() -> list[str]:
    body = chaos_lines() + soak_lines()
    if not body:
        return []
    intro = (
        "## Reliability\n\nNothing lost when processes die, and memory, files and threads flat under hours of "
        "load. How each run came about: [measurement history](performance-history.md)."
    )
    return [intro, "", *body]
