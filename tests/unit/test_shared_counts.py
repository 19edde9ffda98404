"""The front ends' shared counts (server/shared_counts.py): one file every process maps, pickled as its path, and
a lock on it that holds across processes."""

from __future__ import annotations

import os
import pickle

from embedserv.server.shared_counts import SharedCounts


def test_a_second_mapping_sees_the_same_counts(tmp_path):
    counts = SharedCounts(str(tmp_path / "counts"), 3)
    other = pickle.loads(pickle.dumps(counts))
    assert len(counts) == len(other) == 3 and list(other[i] for i in range(3)) == [0, 0, 0]
    counts[0] = 7
    other[2] = -2
    assert other[0] == 7 and counts[2] == -2
    other.close()
    counts.close()


def test_increments_under_the_lock_from_two_processes_are_never_lost(tmp_path):
    counts = SharedCounts(str(tmp_path / "counts"), 1)
    rounds = 20_000

    def add() -> None:
        mine = SharedCounts(counts.path)
        lock = mine.get_lock()
        for _ in range(rounds):
            with lock:
                mine[0] = mine[0] + 1

    child = os.fork()
    if child == 0:
        try:
            add()
        finally:
            os._exit(0)
    add()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert counts[0] == 2 * rounds
    counts.close()
