"""--worker-timeout: a worker that holds a batch past the limit is killed and replaced; its inputs fail
UNAVAILABLE (no other worker to retry on), and the replacement serves the next calls.

The engine runs its real worker process here (no gRPC). A limit of 0.3 s is far below what one
16,384-token batch of MiniLM takes on the CPU (seconds), and far above what one short input takes.
"""

from __future__ import annotations

import time

import pytest

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import NotReady
from embedserv.types import EmbedParams


def test_watchdog_kills_a_stuck_worker_and_a_new_one_serves(bundled_dir):
    # No warm-up: at this budget it takes seconds per worker start, twice here, and it is not the subject.
    config = ModelConfig(
        path=str(bundled_dir), served_name="m", worker_timeout=0.3, max_batch_tokens=16384, warm_up=False
    )
    with SyncEngine(config, worker_processes=True) as engine:
        first_pid = engine.worker_stats()[0].pid
        long_texts = [" ".join(stdlib_texts(8, seed=i)) for i in range(64)]
        with pytest.raises(NotReady, match="died"):
            engine.embed(long_texts, EmbedParams(truncate=True))
        deadline = time.monotonic() + 60
        while True:
            stats = engine.worker_stats()[0]
            if stats.ready and stats.pid != first_pid:
                break
            assert time.monotonic() < deadline, f"no replacement worker: {stats}"
            time.sleep(0.1)
        assert stats.restarts == 1
        # A short input finishes well inside the limit.
        assert engine.embed(["hello"]).embeddings.shape == (1, 384)
