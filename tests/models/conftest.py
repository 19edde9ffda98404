"""Fixtures shared by the model parity tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.corpus import stdlib_texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """40 real texts, some longer than 128 tokens, the sample every parity test compares on."""
    return stdlib_texts(40, seed=1)


# With worker processes, at most this many engines stay started in a module (each holds N processes, and a
# module can ask for a dozen models): the least recently used one is closed first.
_LIVE_PROCESS_ENGINES = 3


@pytest.fixture(scope="module")
def engine_for(request):
    """Factory: engine_for(model_dir, **ModelConfig kwargs) -> a started SyncEngine, shared in the module.

    In this process, or with `--data-parallel-size N` in N worker processes as the server runs models. Without
    the warm-up unless `warm_up=True` (it runs every batch shape and row count: about 5 s for MiniLM on 2 cores,
    for a handful of calls; the answers do not depend on it, which tests/models/test_row_padding.py checks)."""
    data_parallel_size = request.config.getoption("--data-parallel-size")
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    engines: dict[tuple, SyncEngine] = {}

    def get(model_dir: Path, attention_backend: str = "sdpa", dtype: str = "float32", warm_up: bool = False, **kwargs):
        key = (str(model_dir), attention_backend, dtype, warm_up, tuple(sorted(kwargs.items())))
        if key in engines:
            engines[key] = engines.pop(key)  # now the most recently used
            return engines[key]
        if data_parallel_size:
            kwargs["data_parallel_size"] = data_parallel_size
            while len(engines) >= _LIVE_PROCESS_ENGINES:
                engines.pop(next(iter(engines))).close()
        config = ModelConfig(
            path=str(model_dir), served_name="m", attention_backend=attention_backend, dtype=dtype, warm_up=warm_up,
            **kwargs,
        )  # fmt: skip
        engines[key] = SyncEngine(config, warm_up=warm_up, worker_processes=data_parallel_size > 0)
        return engines[key]

    try:
        yield get
    finally:
        for engine in engines.values():
            engine.close()
