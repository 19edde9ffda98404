"""benchmarks/replicas.py gives each replica its own cores while there are enough, and wraps around after."""

from __future__ import annotations

import os

import pytest

from benchmarks.replicas import core_shares, tree_cpu_seconds


def test_replicas_take_their_own_cores_then_share_them():
    assert core_shares(1, 1, [0, 1]) == [[0]]
    assert core_shares(2, 1, [0, 1]) == [[0], [1]]
    assert core_shares(4, 1, [0, 1]) == [[0], [1], [0], [1]]
    assert core_shares(2, 2, [4, 5, 6, 7]) == [[4, 5], [6, 7]]
    assert core_shares(3, 2, [0, 1, 2, 3]) == [[0, 1], [2, 3], [0, 1]]


def test_more_cores_per_replica_than_there_are_is_refused():
    with pytest.raises(SystemExit, match="--cores-per-replica must be 1..2"):
        core_shares(1, 3, [0, 1])


def test_tree_cpu_seconds_counts_this_process():
    before = tree_cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))
    assert tree_cpu_seconds(os.getpid()) > before
