"""Rerank with image documents on text-image dual encoders (CLIP, SigLIP): each image (and text) document is
scored by the cosine of the query text's and its embedding, as transformers' get_text_features /
get_image_features give them; text-only models refuse image documents, naming them, and these models refuse an
image with text as a document and an image as the query."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import InvalidInput
from embedserv.types import ImageInput, RerankParams
from tests.helpers.vision_models import MIXED_IMAGES, image_bytes, reference_embeddings, save_dual_encoder

QUERY = "a photo of a cat"


def _documents() -> list:
    images = [ImageInput(image_bytes(w, h, fmt, seed=i)) for i, (w, h, fmt) in enumerate(MIXED_IMAGES)]
    return [images[0], "two dogs in the snow", *images[1:]]


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_image_documents_are_ranked_by_cosine_as_transformers_embeds_them(kind, tmp_path):
    model_dir = save_dual_encoder(tmp_path / kind, kind, seed=5)
    documents = _documents()
    reference = reference_embeddings(model_dir, kind, [QUERY, *documents])
    unit = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    expected = unit[1:] @ unit[0]
    config = ModelConfig(path=str(model_dir), served_name=kind, warm_up=False)
    with SyncEngine(config, warm_up=False) as engine:
        result = engine.rerank(QUERY, documents, RerankParams())
        with pytest.raises(InvalidInput, match="chunking applies to text documents; document 0 is an image"):
            engine.rerank(QUERY, documents, RerankParams(chunking=True))
        with pytest.raises(InvalidInput, match=f"model '{kind}' takes an image alone; document 0 has text with its"):
            engine.rerank(QUERY, [ImageInput(documents[0].data, "a cat")], RerankParams())
        with pytest.raises(InvalidInput, match=f"model '{kind}' takes a text query, and the query is an image"):
            engine.rerank(documents[0], ["two dogs"], RerankParams())
    assert [r.index for r in result.results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r.score for r in result.results], np.sort(expected)[::-1], rtol=0, atol=1e-4)


def test_text_only_model_refuses_image_documents(bundled_dir):
    config = ModelConfig(path=str(bundled_dir), served_name="minilm", warm_up=False)
    with SyncEngine(config, warm_up=False) as engine:
        with pytest.raises(InvalidInput, match="model 'minilm' takes text only; document 1 is an image"):
            engine.rerank("q", ["a text", ImageInput(image_bytes(32, 32))], RerankParams())
        with pytest.raises(InvalidInput, match="model 'minilm' takes a text query, and the query is an image"):
            engine.rerank(ImageInput(image_bytes(32, 32)), ["a text"], RerankParams())
