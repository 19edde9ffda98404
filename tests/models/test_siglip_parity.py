"""SigLIP served by the engine equals transformers' SiglipModel: texts padded to the model's length as its
processor pads them (the text tower reads the last position), images pooled by the attention-pooling head,
in one call mixing texts and images, alone or packed; what it refuses; reranking by cosine pads alike."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams, RerankParams
from tests.helpers import dual_encoder_checks as checks
from tests.helpers.vision_models import (
    SIGLIP_TEXT_LENGTH,
    load_reference,
    mixed_inputs,
    reference_embeddings,
    save_dual_encoder,
)


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return save_dual_encoder(tmp_path_factory.mktemp("siglip"), "siglip", seed=5)


@pytest.fixture(scope="module")
def siglip(siglip_dir):
    with SyncEngine(ModelConfig(path=str(siglip_dir), served_name="siglip", warm_up=False)) as engine:
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


def test_token_ids_are_padded_as_texts(siglip):
    text = "a photo of two cats"
    ids = siglip.engine.served.tokenizer.hf_tokenizer(text)["input_ids"]
    from_ids = siglip._call(siglip.engine.embedding.embed_token_ids([ids], EmbedParams())).embeddings
    np.testing.assert_allclose(from_ids, siglip.embed([text], EmbedParams()).embeddings, rtol=1e-5, atol=1e-6)


def test_rerank_by_cosine_pads_texts(siglip, siglip_dir):
    query, documents = "a cat", ["a dog on a sofa", "the cat sat on the mat", "red"]
    want = reference_embeddings(siglip_dir, "siglip", [query, *documents])
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    scores = {r.index: r.score for r in siglip.rerank(query, documents, RerankParams()).results}
    np.testing.assert_allclose([scores[i] for i in range(3)], want[1:] @ want[0], atol=1e-4)


def test_warm_up_runs_both_towers(siglip, siglip_dir, caplog):
    """Warm-up runs text and image steps (the linears' row counts on CPU), and changes no result."""
    inputs = mixed_inputs()
    want = siglip.embed(inputs, EmbedParams()).embeddings
    with caplog.at_level(logging.INFO, logger="embedserv.worker.model_runner"):
        with SyncEngine(ModelConfig(path=str(siglip_dir), served_name="warm"), warm_up=True) as engine:
            got = engine.embed(inputs, EmbedParams()).embeddings
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    made = [int(r.getMessage().split()[2]) for r in caplog.records if r.getMessage().startswith("warmed up")]
    assert made and made[0] > 0, caplog.text


def test_pooling_head_reads_each_image_alone(siglip_dir):
    """The attention-pooling head over a flat batch of images of different row counts equals transformers'
    head on each image by itself (preprocessing makes equal counts; the head must not rely on it)."""
    import torch

    from embedserv.models import registry
    from embedserv.models.heads.pooling import PoolingInputs
    from embedserv.models.loading.weights import load_weights

    reference = load_reference(siglip_dir)
    family = registry.lookup("siglip")
    ours = family.model_class(reference.config)
    load_weights(ours, family, reference.state_dict().items())
    lens = torch.tensor([16, 5, 11])
    starts = torch.cumsum(lens, 0) - lens
    hidden = torch.randn(int(lens.sum()), 48, generator=torch.Generator().manual_seed(0))
    pooling = PoolingInputs(
        first_index=starts,
        last_index=starts + lens - 1,
        token_index=None,
        token_seq=torch.repeat_interleave(torch.arange(3), lens),
        token_count=lens.float(),
    )
    with torch.no_grad():
        got = ours.pool(hidden, pooling, images=True)
        vision = reference.vision_model
        want = torch.cat([vision.head(vision.post_layernorm(rows[None])) for rows in hidden.split(lens.tolist())])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
