"""glibc malloc settings for a worker process, which the worker sets itself (nothing for a user to know).

A step allocates and frees the same large buffers again and again (models/layers.py keeps their sizes to a
bounded set). With glibc's defaults the heap's top is handed back to the kernel whenever more than twice
the largest freed block lies free there, which is after nearly every step, and the next step faults the
same pages in again: 4,500 to 9,000 page faults a step on MiniLM at 4,096 tokens, 2-4% of its time
(docs/performance-history.md, "Memory under steady load"). Settings:
- mmap threshold 32 MiB (glibc's ceiling; fixed, where glibc would adapt it): blocks below it come from
  the heap, as they do after glibc's own adaptation;
- trim threshold 1 GiB: the heap's free top is kept, up to that much, for the next step.
What the heap then holds is bounded by the largest step, not by time. After loading and warming up, one
malloc_trim(0) hands back what loading left free.

Where the C library is not glibc (no mallopt), nothing changes.

CPU workers run on tcmalloc instead where it is installed (`--cpu-allocator`, default auto): the server
starts them with it in LD_PRELOAD (`worker_environment`), as vLLM's CPU guide does for its workers. Its
per-thread caches make the many short-lived buffers of a step cheaper: MiniLM in process, interleaved
rounds, 1.10-1.12x int8, 1.05-1.11x bfloat16, 1.02-1.09x float32 over glibc with the settings above
(docs/performance-history.md, issue 33). The glibc settings are then moot (they set an allocator nobody calls).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path

from embedserv.errors import ConfigError

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


# Where distributions put tcmalloc (Debian/Ubuntu's libtcmalloc-minimal4, Fedora's gperftools-libs).
_TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def find_tcmalloc() -> str | None:
    for path in _TCMALLOC_PATHS:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal")
    return name and (name if os.path.isabs(name) else _loadable(name))


def _loadable(name: str) -> str | None:
    try:
        ctypes.CDLL(name)
    except OSError:
        return None
    return name


def worker_environment(requested: str, device: str) -> dict[str, str]:
    """What to add to a worker's environment for --cpu-allocator `requested` (a ConfigError names what is
    missing when tcmalloc is asked for and not installed); nothing for CUDA workers."""
    if device != "cpu" or requested == "glibc":
        return {}
    path = find_tcmalloc()
    if path is None:
        if requested == "tcmalloc":
            raise ConfigError(
                "--cpu-allocator tcmalloc: no libtcmalloc_minimal.so.4 found; install tcmalloc "
                "(Debian/Ubuntu: apt install libtcmalloc-minimal4) or use --cpu-allocator auto"
            )
        _tell_once_how_to_get_tcmalloc()
        return {}
    preload = " ".join(filter(None, (os.environ.get("LD_PRELOAD"), path)))
    return {"LD_PRELOAD": preload}


_told = False


def _tell_once_how_to_get_tcmalloc() -> None:
    global _told
    if not _told:
        _told = True
        logger.info(
            "CPU workers run on glibc's malloc: tcmalloc (libtcmalloc_minimal.so.4) is not installed here; "
            "with it they run 1.02-1.12x faster (MiniLM, docs/performance-history.md). Debian/Ubuntu: "
            "apt install libtcmalloc-minimal4 (the Docker image has it); --cpu-allocator glibc silences this"
        )


def in_use() -> str:
    """The allocator this process runs on, for the start-up log."""
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_step_memory() -> bool:
    """Sets the thresholds above for this process; False where they could not be set."""
    libc = _glibc()
    if libc is None:
        logger.info("not glibc: the allocator keeps its defaults")
        return False
    # mallopt returns 1 on success.
    return libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and (
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )


def release_free_memory() -> None:
    """Hands every free page of the heap back to the kernel (glibc's malloc_trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
