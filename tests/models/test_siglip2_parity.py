"""SigLIP 2 NaFlex served by the engine equals transformers' Siglip2Model: images of different aspect ratios
each at their own grid (position embeddings resized per image), texts padded as its processor pads them,
in one call mixing both, alone or packed; its warm-up; what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams
from tests.helpers import dual_encoder_checks as checks
from tests.helpers.vision_models import mixed_inputs, save_dual_encoder


@pytest.fixture(scope="module")
def siglip2_dir(tmp_path_factory):
    return save_dual_encoder(tmp_path_factory.mktemp("siglip2"), "siglip2", seed=9)


@pytest.fixture(scope="module")
def siglip2(siglip2_dir):
    with SyncEngine(ModelConfig(path=str(siglip2_dir), served_name="siglip2", warm_up=False)) as engine:
        yield engine


def test_mixed_call_equals_transformers(siglip2, siglip2_dir):
    checks.check_mixed_call(siglip2, siglip2_dir, "siglip2")


def test_batch_invariance(siglip2):
    checks.check_batch_invariance(siglip2)


def test_info(siglip2):
    checks.check_info(siglip2, dimension=48)


def test_refusals(siglip2):
    checks.check_refusals(siglip2)


def test_warm_up(siglip2, siglip2_dir):
    inputs = mixed_inputs()
    want = siglip2.embed(inputs, EmbedParams()).embeddings
    with SyncEngine(ModelConfig(path=str(siglip2_dir), served_name="warm"), warm_up=True) as engine:
        got = engine.embed(inputs, EmbedParams()).embeddings
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_two_worker_processes_embed_images_as_one(siglip2, siglip2_dir):
    """Each image's grid crosses to the worker processes with its rows (the position embeddings need it)."""
    inputs = mixed_inputs()
    want = siglip2.embed(inputs, EmbedParams()).embeddings
    config = ModelConfig(path=str(siglip2_dir), served_name="siglip2", data_parallel_size=2, warm_up=False)
    with SyncEngine(config, worker_processes=True) as two:
        results = two.embed_concurrently([[item] for item in inputs], EmbedParams())
    np.testing.assert_allclose(np.concatenate([r.embeddings for r in results]), want, rtol=1e-5, atol=1e-6)
