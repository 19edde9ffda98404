"""A worker process's memory ceiling (--worker-memory-limit): past it, the worker is replaced between steps.

A size (`3GiB`) is each worker's ceiling; a percentage (`80%`) is that share of the container's memory limit
(its cgroup's, as Kubernetes sets it from the pod's limit), split evenly among the model's workers. The resident
set size is read from /proc, so the check is Linux's; elsewhere, or with no limit set, there is none.
"""

from __future__ import annotations

import os
from pathlib import Path

from embedserv.errors import ConfigError
from embedserv.sizes import parse_bytes

# cgroup v2, then v1: the container's memory limit ("max" or a huge number: none).
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_NO_LIMIT = 2**60


def check(text: str) -> None:
    """ConfigError unless `text` is empty (no ceiling), a size or a percentage in (0, 100]."""
    if not text:
        return
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ConfigError(f"--worker-memory-limit {text!r}: a percentage must be above 0% and at most 100%")
        return
    if parse_bytes(text, "--worker-memory-limit") <= 0:
        raise ConfigError("--worker-memory-limit must be above 0 (leave it unset for no ceiling)")


def container_limit(paths: tuple[Path, ...] | None = None) -> int | None:
    """This container's memory limit in bytes, None when it has none (or is not in a cgroup we read)."""
    for path in paths or _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        value = int(text)
        return value if value < _NO_LIMIT else None
    return None


def ceiling_bytes(text: str, workers: int, limit: int | None = None) -> int:
    """Each worker's ceiling in bytes (0: none). A percentage needs the container's limit (`limit`, else read)."""
    if not text:
        return 0
    if not text.endswith("%"):
        return parse_bytes(text, "--worker-memory-limit")
    limit = container_limit() if limit is None else limit
    if limit is None:
        raise ConfigError(
            f"--worker-memory-limit {text} is a share of the container's memory limit, and this container has none; "
            "give a size (3GiB) instead"
        )
    return int(limit * float(text[:-1]) / 100 / workers)


def rss_bytes(pid: int) -> int | None:
    """The resident set size of process `pid`, None when it cannot be read (gone, or not Linux)."""
    try:
        resident = Path(f"/proc/{pid}/statm").read_text().split()[1]
    except (OSError, IndexError):
        return None
    return int(resident) * os.sysconf("SC_PAGE_SIZE")
