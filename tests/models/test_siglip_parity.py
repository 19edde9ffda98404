"""SigLIP served by the engine equals transformers' SiglipModel: texts padded to the model's length as its
processor pads them (the text tower reads the last position), images pooled by the attention-pooling head,
in one call mixing texts and images, alone or packed; what it refuses; reranking by cosine pads alike."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams, RerankParams
from tests.helpers import dual_encoder_checks as checks
from tests.helpers.vision_models import SIGLIP_TEXT_LENGTH, reference_embeddings, save_dual_encoder


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return save_dual_encoder(tmp_path_factory.mktemp("siglip"), "siglip", seed=5)


@pytest.fixture(scope="module")
def siglip(siglip_dir):
    with SyncEngine(ModelConfig(path=str(siglip_dir), served_name="siglip", warm_up=False), warm_up=False) as engine:
        yield engine


def test_mixed_call_equals_transformers(siglip, siglip_dir):
    checks.check_mixed_call(siglip, siglip_dir, "siglip")


def test_batch_invariance(siglip):
    checks.check_batch_invariance(siglip)


def test_info(siglip):
    checks.check_info(siglip, dimension=48)
    assert siglip.info.max_input_tokens == SIGLIP_TEXT_LENGTH


def test_refusals(siglip):
    checks.check_refusals(siglip)


def test_texts_run_padded_to_the_model_length(siglip):
    """Usage counts the padded tokens: every text runs as SIGLIP_TEXT_LENGTH tokens."""
    result = siglip.embed(["short", "a somewhat longer text than the first one"], EmbedParams(bypass_cache=True))
    assert result.prompt_tokens == 2 * SIGLIP_TEXT_LENGTH


def test_rerank_by_cosine_pads_texts(siglip, siglip_dir):
    query, documents = "a cat", ["a dog on a sofa", "the cat sat on the mat", "red"]
    want = reference_embeddings(siglip_dir, "siglip", [query, *documents])
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    scores = {r.index: r.score for r in siglip.rerank(query, documents, RerankParams()).results}
    np.testing.assert_allclose([scores[i] for i in range(3)], want[1:] @ want[0], atol=1e-4)
