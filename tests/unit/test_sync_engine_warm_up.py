"""The in-process engine (SyncEngine, and the Ray Data stage built on it) warms up as its ModelConfig says, as the
server's workers do; the constructor's `warm_up` overrides it either way."""

from __future__ import annotations

import pytest

from embedserv.batch.ray_data import Embedder
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.worker.model_runner import ModelRunner


@pytest.fixture()
def warm_ups(monkeypatch) -> list[int]:
    """The max_batch_tokens of each warm-up run (the warm-up itself skipped: only whether it ran matters)."""
    runs: list[int] = []
    monkeypatch.setattr(
        ModelRunner, "warm_up", lambda self, max_tokens, max_batch_tokens: runs.append(max_batch_tokens)
    )
    return runs


@pytest.mark.parametrize(
    ("in_config", "argument", "warms_up"),
    [(True, None, True), (False, None, False), (True, False, False), (False, True, True)],
)
def test_the_config_says_and_the_argument_overrides(bundled_dir, warm_ups, in_config, argument, warms_up):
    config = ModelConfig(path=str(bundled_dir), served_name="m", warm_up=in_config, max_batch_tokens=512)
    with SyncEngine(config, **({} if argument is None else {"warm_up": argument})) as engine:
        assert engine.embed(["a text"]).embeddings.shape == (1, 384)
    assert warm_ups == ([512] if warms_up else [])


def test_the_ray_data_stage_takes_warm_up_off_as_a_model_option(bundled_dir, warm_ups):
    stage = Embedder(str(bundled_dir), warm_up=False)
    try:
        assert len(stage({"text": ["a text"]})["embedding"]) == 1
    finally:
        stage.engine.close()
    assert warm_ups == []
