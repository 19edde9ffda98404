"""Processes seen through /proc (Linux only, no psutil): a server's children, its workers, who is alive.

A pid is only a number: once a process is gone and reaped, the kernel may give its pid to another one.
So "is this worker still running" is asked as "is `pid` alive *and* does its command line still name
the worker module" (`survivors`), never as "does `pid` exist".
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from embedserv.executor import zygote

# A worker process started plain runs `python -m embedserv.executor.worker_main ...`, as does a zygote started plain.
# What a zygote forks has the zygote's command line (the server's, where the server forked it) and a name of its own.
WORKER_MARKER = "embedserv.executor.worker_main"
# What the command line of a front-end process (`--frontends N`) started by multiprocessing's spawn holds.
FRONTEND_MARKER = "multiprocessing.spawn"

T = TypeVar("T")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat, numbered as in proc(5) from 1 (so index 0 is field 1, the pid); None if gone.

    Field 2, the command name, is in parentheses and may itself hold spaces and parentheses: split after
    the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    head, _, rest = raw.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    return [pid_text, comm, *rest.split()]


def state(pid: int) -> str | None:
    """The one-letter state of proc(5) (R, S, D, Z, ...), or None when there is no such process."""
    fields = _stat(pid)
    return fields[2] if fields else None


def command_name(pid: int) -> str | None:
    """The process's name (/proc/PID/comm), or None when there is no such process."""
    fields = _stat(pid)
    return fields[1] if fields else None


def parent_pid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None


def session_id(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[5]) if fields else None


def cmdline(pid: int) -> list[str]:
    """The process's argv; [] when it is gone, a zombie or a kernel thread."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def all_pids() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def is_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped) counts as dead."""
    return state(pid) not in (None, "Z", "X", "x")


def child_pids(parent: int) -> list[int]:
    """Pids of the live processes whose parent is `parent`, in increasing order."""
    return [pid for pid in all_pids() if parent_pid(pid) == parent and is_alive(pid)]


def has_marker(pid: int, marker: str = WORKER_MARKER) -> bool:
    return marker in " ".join(cmdline(pid))


def worker_pids(server_pid: int) -> list[int]:
    """The live worker processes of the server `server_pid`: its children started as embedserv.executor.worker_main,
    or forked by its zygote and named so (executor/zygote.py)."""
    return [pid for pid in child_pids(server_pid) if role(pid) == "worker"]


def frontend_pids(server_pid: int) -> list[int]:
    """The live front-end processes of the server `server_pid`: spawned by multiprocessing, or forked by its zygote."""
    return [pid for pid in child_pids(server_pid) if role(pid) == "front end"]


def named_worker_pid(server_pid: int, log_path: Path, name: str) -> int | None:
    """The live worker `name` (MODEL/INDEX) of the server `server_pid`: the pid its log last said it started it
    as (a forked worker's command line is its zygote's, which does not name it)."""
    started = re.findall(rf"started worker {re.escape(name)} \(pid (\d+)\)", log_path.read_text(errors="replace"))
    return int(started[-1]) if started and int(started[-1]) in worker_pids(server_pid) else None


def zygote_pids(server_pid: int) -> list[int]:
    """The live worker zygotes of the server `server_pid`."""
    return [pid for pid in child_pids(server_pid) if role(pid) == "zygote"]


def role(pid: int) -> str:
    """What the process is among a server's: "zygote", "front end", "worker", or "other" (the server itself, or a
    process that is none of these). By the names the zygote gives, else by the command line of a process started
    plain: a worker's, or a zygote's not yet named while it imports (taken for a worker, as are the workers that
    earlier commits' zygotes forked without a name: benchmarks run those too)."""
    name = command_name(pid)
    if name == zygote.NAME:
        return "zygote"
    if name == zygote.FRONTEND_NAME or has_marker(pid, FRONTEND_MARKER):
        return "front end"
    return "worker" if name == zygote.WORKER_NAME or has_marker(pid) else "other"


def survivors(pids: Iterable[int]) -> list[int]:
    """Those of `pids` still alive and still a server's worker, zygote or front end (a reused pid is not one)."""
    return [pid for pid in pids if is_alive(pid) and role(pid) != "other"]


def kill_survivors(pids: Iterable[int]) -> list[int]:
    """SIGKILL those of `pids` that `survivors` still finds (clean-up after a failed test); return them."""
    left = survivors(pids)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


def wait_for(
    predicate: Callable[[], T], timeout: float, interval: float = 0.1, what: str | Callable[[], str] = "a condition"
) -> T:
    """Call `predicate` until it returns something truthy and return that; raise AssertionError after `timeout` s.

    `what` describes the wait in the error; it may be a callable (say, one that adds a server's log tail),
    called only on failure. The last falsy value is in the error too.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            description = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g}s waiting for {description} (last value: {value!r})")
        time.sleep(interval)
