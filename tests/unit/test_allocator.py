"""The worker's malloc settings (worker/allocator.py): the large buffers a step frees stay mapped for the
next step instead of going back to the kernel (and being faulted in again) at every step's end.

Each case runs in a fresh interpreter, with blocks from glibc's malloc itself: malloc settings are per
process, and the test must start from glibc's defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embedserv.worker import allocator
from tests.helpers.server import REPO_ROOT

pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="the C library is not glibc")

# Three steps that each fill four 24 MiB blocks (a large model's activations) and free them; prints the MiB
# of resident memory the last step's frees handed back to the kernel. With `release`, then malloc_trim.
_STEPS = """
import ctypes, sys
from embedserv.worker import allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] != "default":
    assert allocator.keep_step_memory()
def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
size = 24 * 2**20
for _ in range(3):
    blocks = [libc.malloc(size) for _ in range(4)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    before = rss_mib()
    for block in blocks:
        libc.free(block)
if sys.argv[1] == "release":
    allocator.release_free_memory()
print(before - rss_mib())
"""


def _mib_handed_back(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_a_steps_freed_buffers_stay_mapped():
    # glibc's defaults trim the heap's free top (96 MiB here) at the step's end; the next step faults it in.
    assert _mib_handed_back("default") > 80
    assert _mib_handed_back("tuned") < 2


def test_release_hands_free_pages_back():
    assert _mib_handed_back("release") > 80
