"""CPU worker processes are forked by one zygote (executor/zygote.py) and are still the engine's children.

The zygote imports torch and transformers once; each worker, the second and every replacement, is forked from it
and reparented to the engine's process, in a session of its own, as if the engine had started it. With
EMBEDSERV_WORKER_ZYGOTE=0 the workers start plainly.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams
from tests.helpers.processes import cmdline, parent_pid, session_id, wait_for, zygote_pids

TEXTS = [["a first text"], ["another text, a little longer than the first"], ["three"]]


def _engine(model_dir) -> SyncEngine:
    config = ModelConfig(path=str(model_dir), served_name="m", data_parallel_size=2, warm_up=False)
    return SyncEngine(config, worker_processes=True)


def _vectors(engine: SyncEngine) -> np.ndarray:
    return np.concatenate([r.embeddings for r in engine.embed_concurrently(TEXTS, EmbedParams())])


def _ready_pids(engine: SyncEngine) -> list[int]:
    stats = engine.worker_stats()
    return [s.pid for s in stats] if all(s.ready for s in stats) else []


def test_workers_are_forked_by_one_zygote_and_a_replacement_too(bundled_dir):
    zygotes_before = set(zygote_pids(os.getpid()))
    with _engine(bundled_dir) as engine:
        want = _vectors(engine)
        first = _ready_pids(engine)
        zygotes = set(zygote_pids(os.getpid())) - zygotes_before
        assert len(zygotes) == 1, f"one zygote for both workers, found {zygotes}"
        for pid in first:
            assert parent_pid(pid) == os.getpid() and session_id(pid) == pid
            assert "--zygote" in cmdline(pid), cmdline(pid)
        os.kill(first[0], signal.SIGKILL)
        pids = wait_for(lambda: (p := _ready_pids(engine)) and first[0] not in p and p, 120, what="a replacement")
        (new,) = set(pids) - set(first)
        assert parent_pid(new) == os.getpid() and session_id(new) == new and "--zygote" in cmdline(new)
        assert set(zygote_pids(os.getpid())) - zygotes_before == zygotes, "the replacement came from the same zygote"
        assert np.array_equal(_vectors(engine), want)


def test_without_the_zygote_workers_start_plainly(bundled_dir, monkeypatch):
    monkeypatch.setenv("EMBEDSERV_WORKER_ZYGOTE", "0")
    zygotes_before = set(zygote_pids(os.getpid()))
    with _engine(bundled_dir) as engine:
        _vectors(engine)
        for pid in _ready_pids(engine):
            assert parent_pid(pid) == os.getpid() and session_id(pid) == pid
            assert "--zygote" not in cmdline(pid), cmdline(pid)
        assert set(zygote_pids(os.getpid())) <= zygotes_before
