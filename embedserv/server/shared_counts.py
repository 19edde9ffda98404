"""Counts every front-end process shares: int64s in a file each maps, changed under a lock on that file.

What multiprocessing.Array("q") gives (indexing and get_lock()), but reached by a path, so a process that was not
started by multiprocessing (a front end forked by the zygote: executor/zygote.py) opens it too; it pickles as its
path. The lock is flock(2): the kernel drops it when its holder dies, so a front end killed inside it cannot stop
the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os


class SharedCounts:
    def __init__(self, path: str, size: int | None = None) -> None:
        """Opens the counts at `path`; with `size`, creates them (zeros)."""
        self.path = path
        self._fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if size is not None else 0), 0o600)
        if size is not None:
            os.ftruncate(self._fd, 8 * size)
        self._map = mmap.mmap(self._fd, 0)
        self._counts = memoryview(self._map).cast("q")

    def __len__(self) -> int:
        return len(self._counts)

    def __getitem__(self, index: int) -> int:
        return self._counts[index]

    def __setitem__(self, index: int, value: int) -> None:
        self._counts[index] = value

    def __reduce__(self):
        return SharedCounts, (self.path,)

    def get_lock(self) -> contextlib.AbstractContextManager:
        """The lock, for a with-block."""
        return _Lock(self)

    def close(self) -> None:
        self._counts.release()
        self._map.close()
        os.close(self._fd)


class _Lock:
    """flock on the counts' file, as a reusable with-block (not reentrant, like multiprocessing's default)."""

    def __init__(self, counts: SharedCounts) -> None:
        self._counts = counts

    def __enter__(self) -> None:
        fcntl.flock(self._counts._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._counts._fd, fcntl.LOCK_UN)
