"""What the CLIP and SigLIP parity tests (tests/models/test_clip_parity.py, test_siglip_parity.py) both show of
an engine serving a dual encoder: embeddings equal transformers', mixed calls, batch invariance, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedserv.engine.sync import SyncEngine
from embedserv.errors import InvalidInput
from embedserv.types import EmbedParams, ImageInput, LateChunking, Modality, RerankParams
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm, normalized
from tests.helpers.vision_models import image_bytes, mixed_inputs, reference_embeddings

COSINE = 0.9999


def check_mixed_call(engine: SyncEngine, model_dir: Path, kind: str) -> None:
    """One call of texts and images of different sizes and formats equals transformers, input by input,
    with normalize off and on."""
    inputs = mixed_inputs()
    want = reference_embeddings(model_dir, kind, inputs)
    raw = engine.embed(inputs, EmbedParams(normalize=False)).embeddings
    assert_cosine_at_least(raw, want, COSINE, what=f"{kind} raw: ")
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(want, axis=1), rtol=1e-4)
    unit = engine.embed(inputs, EmbedParams(normalize=True)).embeddings
    assert_unit_norm(unit)
    assert_cosine_at_least(unit, normalized(want), COSINE, what=f"{kind} normalized: ")
    # The inputs are far apart: a mix-up of the order would show.
    assert np.max(np.abs(np.triu(normalized(want) @ normalized(want).T, 1))) < 0.999


def check_batch_invariance(engine: SyncEngine) -> None:
    """Each input alone gives what it gives in the mixed call, and calls sent at once (packed in one step,
    split into a text pass and an image pass) give what they give alone."""
    inputs = mixed_inputs()
    together = engine.embed(inputs, EmbedParams(normalize=False)).embeddings
    alone = np.concatenate([engine.embed([item], EmbedParams(normalize=False)).embeddings for item in inputs])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)
    concurrent = engine.embed_concurrently([[item] for item in inputs], EmbedParams(normalize=False))
    np.testing.assert_allclose(np.concatenate([r.embeddings for r in concurrent]), alone, rtol=1e-5, atol=1e-5)


def check_info(engine: SyncEngine, dimension: int) -> None:
    info = engine.info
    assert info.modalities == (Modality.TEXT, Modality.IMAGE)
    assert info.dimension == dimension
    assert [str(o) for o in info.outputs] == ["dense"]


def check_refusals(engine: SyncEngine) -> None:
    """Calls that make no sense with images, or with a dual encoder, are refused naming what to change."""
    image = ImageInput(image_bytes(40, 40))
    with pytest.raises(InvalidInput, match="chunking and late_chunking are not served"):
        engine.embed(["a text", image], EmbedParams(late_chunking=LateChunking()))
    with pytest.raises(InvalidInput, match="chunking and late_chunking are not served"):
        engine.embed(["a text"], EmbedParams(chunking=True))
    with pytest.raises(InvalidInput, match="chunking is not served"):
        engine.rerank("a query", ["a document"], RerankParams(chunking=True))
    with pytest.raises(InvalidInput, match="prompt_name applies to texts"):
        engine.embed([image], EmbedParams(prompt_name="query"))
    truncated = image_bytes(40, 40)[:60]
    with pytest.raises(InvalidInput, match="input 2"):
        engine.embed(["a", image, ImageInput(truncated)], EmbedParams())
    with pytest.raises(InvalidInput, match="input 0"):
        engine.embed([ImageInput(b"not an image at all")], EmbedParams())
    # The engine still serves after the refusals.
    assert engine.embed(["still here", image], EmbedParams()).embeddings.shape[0] == 2
