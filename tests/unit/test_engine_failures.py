"""A failing batch or a crashed engine loop ends the affected calls with an error; nothing hangs."""

from __future__ import annotations

import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import NotReady
from embedserv.types import EmbedParams


@pytest.fixture()
def engine(bundled_dir):
    with SyncEngine(ModelConfig(path=str(bundled_dir), served_name="m"), warm_up=False) as eng:
        yield eng


def test_failed_batch_fails_its_calls_and_the_engine_goes_on(engine):
    runner = engine.core.workers[0].runner
    run = runner.run

    def broken(prepared):
        raise RuntimeError("device fell over")

    runner.run = broken
    with pytest.raises(RuntimeError, match="inference failed: device fell over"):
        engine.embed(["hello"], EmbedParams())
    runner.run = run
    assert engine.embed(["hello"]).embeddings.shape == (1, 384)


def test_crashed_loop_fails_pending_calls_instead_of_hanging(engine):
    def broken():
        raise RuntimeError("scheduler bug")

    engine.core.prefill.scheduler.pick = broken
    with pytest.raises(NotReady, match="stopped after an internal error"):
        engine.embed(["hello"], EmbedParams())
    # Later calls are refused at once (UNAVAILABLE), not queued forever.
    with pytest.raises(NotReady):
        engine.embed(["again"], EmbedParams())
