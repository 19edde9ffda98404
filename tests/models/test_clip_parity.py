"""CLIP served by the engine equals transformers' CLIPModel: text and image embeddings (get_text_features,
get_image_features on its processor's pixels), in one call mixing texts and images of different sizes and
formats, alone or packed; what it refuses; two worker processes give what one does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams, ImageInput
from tests.helpers import dual_encoder_checks as checks
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.vision_models import decoded, image_bytes, mixed_inputs, save_dual_encoder


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_dual_encoder(tmp_path_factory.mktemp("clip"), "clip", seed=3)


@pytest.fixture(scope="module")
def clip(clip_dir):
    with SyncEngine(ModelConfig(path=str(clip_dir), served_name="clip", warm_up=False)) as engine:
        yield engine


def test_mixed_call_equals_transformers(clip, clip_dir):
    checks.check_mixed_call(clip, clip_dir, "clip")


def test_batch_invariance(clip):
    checks.check_batch_invariance(clip)


def test_info(clip):
    checks.check_info(clip, dimension=24)


def test_refusals(clip):
    checks.check_refusals(clip)


def test_text_only_model_refuses_images(bundled_dir):
    with SyncEngine(ModelConfig(path=str(bundled_dir), served_name="minilm", warm_up=False)) as engine:
        with pytest.raises(InvalidInput, match="model 'minilm' takes text only; input 2 is an image"):
            engine.embed(["a", "b", ImageInput(image_bytes(32, 32))], EmbedParams())


def test_start_up_refuses_a_model_without_its_image_processor(clip_dir, tmp_path):
    copy = tmp_path / "clip"
    copy.mkdir()
    for path in clip_dir.iterdir():
        if path.name != "preprocessor_config.json":
            (copy / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match="no preprocessor_config.json"):
        SyncEngine(ModelConfig(path=str(copy), served_name="clip", warm_up=False))


def test_two_worker_processes_embed_images_as_one(clip, clip_dir):
    inputs = mixed_inputs()
    want = clip.embed(inputs, EmbedParams()).embeddings
    config = ModelConfig(
        path=str(clip_dir), served_name="clip", data_parallel_size=2, max_batch_requests=2, warm_up=False
    )
    with SyncEngine(config, worker_processes=True) as two:
        results = two.embed_concurrently([[item] for item in inputs] + [inputs], EmbedParams())
        stats = two.worker_stats()
    np.testing.assert_allclose(np.concatenate([r.embeddings for r in results[:-1]]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[-1].embeddings, want, rtol=1e-5, atol=1e-6)
    assert all(s.batches > 0 for s in stats), f"both workers should get batches: {stats}"


def test_start_up_refuses_int8(clip_dir):
    with pytest.raises(ConfigError, match="int8 was not validated for text-image dual encoders"):
        SyncEngine(ModelConfig(path=str(clip_dir), served_name="clip", quantization="int8", warm_up=False))


def test_random_bytes_as_images_are_refused_and_the_engine_serves_on(clip):
    """Random bytes, and valid images cut or flipped at random places: each call is served or refused with
    InvalidInput naming its input; none takes the engine down."""
    rng = np.random.default_rng(7)
    good = [image_bytes(33, 47, fmt, seed=1) for fmt in ("PNG", "JPEG", "WEBP")]
    for case in range(60):
        if case % 3 == 0:
            data = rng.integers(0, 256, size=int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        else:
            data = bytearray(good[case % 3])
            if case % 3 == 1:
                data = data[: int(rng.integers(0, len(data)))]
            else:
                for at in rng.integers(0, len(data), size=8):
                    data[at] = int(rng.integers(0, 256))
            data = bytes(data)
        try:
            result = clip.embed(["text", ImageInput(data)], EmbedParams())
        except InvalidInput as exc:
            assert "input 1" in str(exc), str(exc)
        else:
            assert np.isfinite(result.embeddings).all()
    assert clip.embed(mixed_inputs(), EmbedParams()).embeddings.shape == (7, 24)


@pytest.mark.parametrize("layout", ["folder", "root"])
def test_sentence_transformers_directories(clip, clip_dir, tmp_path, layout):
    """sentence-transformers' CLIP: the CLIPModel module in 0_CLIPModel/ (before 5.4), or at the root with only
    processor_config.json for its image settings (as 5.4 on saves it): the same vectors as the model itself,
    which sentence-transformers' own encode gives too."""
    from sentence_transformers import SentenceTransformer

    root = tmp_path / layout
    if layout == "folder":
        shutil.copytree(clip_dir, root / "0_CLIPModel")
        (root / "modules.json").write_text(
            json.dumps(
                [{"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}]
            )
        )
    else:
        SentenceTransformer(str(clip_dir), device="cpu").save(str(root))
        assert not (root / "preprocessor_config.json").exists()
    inputs = mixed_inputs()
    want = clip.embed(inputs, EmbedParams()).embeddings
    with SyncEngine(ModelConfig(path=str(root), served_name="st", warm_up=False)) as engine:
        got = engine.embed(inputs, EmbedParams()).embeddings
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    reference = SentenceTransformer(str(root), device="cpu")
    texts = [item for item in inputs if isinstance(item, str)]
    images = [decoded(item.data) for item in inputs if isinstance(item, ImageInput)]
    assert_cosine_at_least(got[[0, 3, 6]], reference.encode(texts), checks.COSINE)
    assert_cosine_at_least(got[[1, 2, 4, 5]], reference.encode(images), checks.COSINE)


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_published_shapes_load_every_tensor(kind):
    """CLIP ViT-B/32's, SigLIP-base's and SigLIP 2 NaFlex-base's checkpoints (their configs, weightless): every
    tensor has a place of its shape in our model, and every parameter of ours is filled."""
    import torch
    from transformers import CLIPModel, Siglip2Config, Siglip2Model, SiglipModel

    from embedserv.models import registry
    from embedserv.models.loading.weights import load_weights
    from tests.helpers.vision_models import clip_vit_b32_config, siglip_base_config

    config, model_class = {
        "clip": (clip_vit_b32_config, CLIPModel),
        "siglip": (siglip_base_config, SiglipModel),
        "siglip2": (Siglip2Config, Siglip2Model),
    }[kind]
    config = config()
    family = registry.lookup(kind)
    with torch.device("meta"):
        reference = model_class(config)
        ours = family.model_class(config)
    loaded = load_weights(ours, family, reference.state_dict().items())
    assert set(dict(ours.named_parameters())) == loaded


def test_embedding_cache_keys_images_by_their_pixels(clip, clip_dir):
    """Every image has the same placeholder ids: the cache must tell two images apart by their pixels."""
    first, second = (ImageInput(image_bytes(40, 30, seed=seed)) for seed in (11, 12))
    want = clip.embed([first, second], EmbedParams()).embeddings
    config = ModelConfig(path=str(clip_dir), served_name="cached", warm_up=False, embedding_cache=2**20)
    with SyncEngine(config, warm_up=False) as cached:
        got = [cached.embed([item], EmbedParams()).embeddings[0] for item in (first, second, first, second)]
        hits = cached.embedding_cache_stats()
    np.testing.assert_allclose(np.stack(got), np.concatenate([want, want]), rtol=1e-5, atol=1e-6)
    assert hits.hits == 2, hits


def test_bfloat16_stays_close(clip, clip_dir):
    inputs = mixed_inputs()
    want = clip.embed(inputs, EmbedParams()).embeddings
    config = ModelConfig(path=str(clip_dir), served_name="bf16", warm_up=False, dtype="bfloat16")
    with SyncEngine(config, warm_up=False) as engine:
        got = engine.embed(inputs, EmbedParams()).embeddings
    assert_cosine_at_least(got, want, 0.99, what="bfloat16: ")
