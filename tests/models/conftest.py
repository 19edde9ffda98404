"""Fixtures shared by the model parity tests."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from benchmarks.corpus import stdlib_texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """40 real texts, some longer than 128 tokens, the sample every parity test compares on."""
    return stdlib_texts(40, seed=1)


@pytest.fixture(scope="module")
def engine_for():
    """Factory: engine_for(model_dir, **ModelConfig kwargs) -> a started SyncEngine, shared in the module."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    engines: dict[tuple, object] = {}
    with contextlib.ExitStack() as stack:

        def get(model_dir: Path, attention_backend: str = "sdpa", dtype: str = "float32", **kwargs):
            key = (str(model_dir), attention_backend, dtype, tuple(sorted(kwargs.items())))
            if key not in engines:
                config = ModelConfig(
                    path=str(model_dir), served_name="m", attention_backend=attention_backend, dtype=dtype, **kwargs
                )
                engines[key] = stack.enter_context(SyncEngine(config))
            return engines[key]

        yield get
