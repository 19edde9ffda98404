"""CLIP served by the engine equals transformers' CLIPModel: text and image embeddings (get_text_features,
get_image_features on its processor's pixels), in one call mixing texts and images of different sizes and
formats, alone or packed; what it refuses; two worker processes give what one does."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams, ImageInput
from tests.helpers import dual_encoder_checks as checks
from tests.helpers.vision_models import image_bytes, mixed_inputs, save_dual_encoder


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_dual_encoder(tmp_path_factory.mktemp("clip"), "clip", seed=3)


@pytest.fixture(scope="module")
def clip(clip_dir):
    with SyncEngine(ModelConfig(path=str(clip_dir), served_name="clip", warm_up=False), warm_up=False) as engine:
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
    with SyncEngine(ModelConfig(path=str(bundled_dir), served_name="minilm", warm_up=False), warm_up=False) as engine:
        with pytest.raises(InvalidInput, match="model 'minilm' takes text only; input 2 is an image"):
            engine.embed(["a", "b", ImageInput(image_bytes(32, 32))], EmbedParams())


def test_start_up_refuses_a_model_without_its_image_processor(clip_dir, tmp_path):
    copy = tmp_path / "clip"
    copy.mkdir()
    for path in clip_dir.iterdir():
        if path.name != "preprocessor_config.json":
            (copy / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match="no preprocessor_config.json"):
        SyncEngine(ModelConfig(path=str(copy), served_name="clip", warm_up=False), warm_up=False)


def test_two_worker_processes_embed_images_as_one(clip, clip_dir):
    inputs = mixed_inputs()
    want = clip.embed(inputs, EmbedParams()).embeddings
    config = ModelConfig(path=str(clip_dir), served_name="clip", data_parallel_size=2, max_batch_requests=2)
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
