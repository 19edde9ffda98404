"""glibc malloc settings for a worker process, which the worker sets itself (nothing for a user to know).

A step allocates and frees the same large buffers again and again (embedserv/padding.py keeps their sizes to a
bounded set). With glibc's defaults the heap's top is handed back to the kernel whenever more than twice
the largest freed block lies free there, which is after nearly every step, and the next step faults the
same pages in again: 4,500 to 9,000 page faults a step on MiniLM at 4,096 tokens, 2-4% of its time
(docs/PERFORMANCE.md, "Memory under steady load"). Settings:
- mmap threshold 32 MiB (glibc's ceiling; fixed, where glibc would adapt it): blocks below it come from
  the heap, as they do after glibc's own adaptation;
- trim threshold 1 GiB: the heap's free top is kept, up to that much, for the next step.
What the heap then holds is bounded by the largest step, not by time. After loading and warming up, one
malloc_trim(0) hands back what loading left free.

Where the C library is not glibc (no mallopt), nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


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
