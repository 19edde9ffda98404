"""Image preprocessing equals transformers' own image processors (CLIP, SigLIP, Qwen2-VL; their PIL backends) on
PNG, JPEG and WebP bytes of several sizes, aspect ratios and modes; patch_rows equals a conv2d patch embedding;
preprocessor_config.json is read as HF reads it, and what cannot be reproduced is refused at start-up."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    Qwen2VLImageProcessor,
    Siglip2ImageProcessor,
    SiglipImageProcessor,
)

from embedserv.engine.inputs.images import (
    ImageLimits,
    ImageProcessing,
    decode_image,
    patch_rows,
    pixel_values,
    prepare_image,
    read_image_processing,
)
from embedserv.engine.inputs.images.processing import CLIP_MEAN, CLIP_STD, processing_from_dict
from tests.helpers.images import jpeg_bytes, png_bytes, random_image, webp_bytes

LIMITS = ImageLimits(max_bytes=8 << 20, max_pixels=40_000_000)
# Each processor under test: (HF class, its settings, the model's patch size).
PROCESSORS = {
    "clip": (CLIPImageProcessor, {}, 32),
    "clip-small-crop": (CLIPImageProcessor, {"size": {"shortest_edge": 64}, "crop_size": 56, "resample": 2}, 14),
    "clip-short-long": (
        CLIPImageProcessor,
        {"size": {"shortest_edge": 48, "longest_edge": 80}, "do_center_crop": False},
        16,
    ),
    "siglip": (SiglipImageProcessor, {"size": {"height": 96, "width": 96}, "resample": 2}, 16),
    "colpali": (
        SiglipImageProcessor,
        {"size": {"height": 448, "width": 448}, "resample": 3, "image_mean": 0.5, "image_std": 0.5},
        14,
    ),
    "qwen2-vl": (Qwen2VLImageProcessor, {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 96}, 14),
    "qwen2-vl-size": (
        Qwen2VLImageProcessor,
        {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 256 * 28 * 28}, "merge_size": 2, "patch_size": 14},
        14,
    ),
    "siglip2": (Siglip2ImageProcessor, {"max_num_patches": 64, "patch_size": 16}, 16),
    "siglip2-bicubic": (Siglip2ImageProcessor, {"max_num_patches": 100, "patch_size": 8, "resample": 3}, 8),
}
# (width, height): landscape, smaller than every target, very wide, tall and odd.
SIZES = [(300, 200), (40, 30), (1000, 24), (37, 91)]
ENCODERS = {"png": png_bytes, "jpeg": jpeg_bytes, "webp": webp_bytes, "webp-lossy": lambda a: webp_bytes(a, False)}


def _hf_output(processor, data: bytes, **call) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """HF's own pipeline on Pillow's lazily opened image (its own RGB conversion included)."""
    out = processor(Image.open(io.BytesIO(data)), return_tensors="np", **call)
    if "image_grid_thw" in out:
        return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])
    if "spatial_shapes" in out:  # SigLIP2: the rows its attention mask keeps
        kept = int(out["pixel_attention_mask"][0].sum())
        return out["pixel_values"][0][:kept], tuple(int(v) for v in out["spatial_shapes"][0])
    return out["pixel_values"][0], None


def _pair(name: str, tmp_path: Path) -> tuple[object, ImageProcessing]:
    """The HF processor, and ours read from the preprocessor_config.json it saves (plus a config.json)."""
    cls, settings, patch = PROCESSORS[name]
    processor = cls(**settings)
    processor.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": patch}}))
    return processor, read_image_processing(tmp_path)


def _check(processor, processing: ImageProcessing, data: bytes, **call) -> None:
    mine, grid = pixel_values(decode_image(data, 0, LIMITS), processing)
    ref, ref_grid = _hf_output(processor, data, **call)
    assert mine.dtype == np.float32 and mine.shape == ref.shape
    np.testing.assert_allclose(mine, ref, atol=1e-5, rtol=0)
    if ref_grid is not None:
        assert grid == ref_grid
    else:
        assert grid == (ref.shape[1] // processing.patch_size, ref.shape[2] // processing.patch_size)


@pytest.mark.parametrize("name", sorted(PROCESSORS))
@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_pixel_values_equal_the_hf_processor(name: str, encoding: str, tmp_path: Path) -> None:
    processor, processing = _pair(name, tmp_path)
    for seed, (width, height) in enumerate(SIZES):
        _check(processor, processing, ENCODERS[encoding](random_image(seed, width, height)))


def _mode_images() -> dict[str, bytes]:
    rgba = random_image(7, 90, 60, "RGBA")
    rgba[..., 3] = np.linspace(0, 255, 90, dtype=np.uint8)[None, :]  # transparency from clear to opaque
    rgb = Image.fromarray(random_image(8, 90, 60))
    palette = rgb.quantize(32)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 3
    gray16 = Image.fromarray(random_image(9, 90, 60, "L").astype(np.uint16) * 257)
    return {
        "RGBA": png_bytes(rgba),
        "RGBA-webp": webp_bytes(rgba),
        "L": png_bytes(random_image(5, 90, 60, "L")),
        "L-jpeg": jpeg_bytes(random_image(5, 90, 60, "L")),
        "LA": png_bytes(Image.fromarray(rgba).convert("LA")),
        "P": png_bytes(palette),
        "P-transparent": png_bytes(transparent_palette),
        "I;16": png_bytes(gray16),
        "CMYK": jpeg_bytes(rgb.convert("CMYK")),
        "1": png_bytes(rgb.convert("1")),
    }


@pytest.mark.parametrize("name", ["clip-small-crop", "siglip", "qwen2-vl", "siglip2"])
def test_modes_convert_to_rgb_as_hf_does(name: str, tmp_path: Path) -> None:
    """SigLIP2's processor leaves do_convert_rgb unset (an RGBA or L image fails there); it is asked for here, as
    every image is served as RGB; the others convert by default."""
    processor, processing = _pair(name, tmp_path)
    for mode, data in _mode_images().items():
        assert Image.open(io.BytesIO(data)).mode in (mode.split("-")[0], "I", "I;16"), mode
        _check(processor, processing, data, do_convert_rgb=True)


def test_transparency_is_composited_onto_white() -> None:
    clear = np.zeros((16, 16, 4), dtype=np.uint8)
    image = decode_image(png_bytes(clear), 0, LIMITS)
    assert image.mode == "RGB" and np.asarray(image).min() == 255


def test_exif_orientation_is_not_applied() -> None:
    """HF does not rotate by EXIF, so neither do we: the pixels are the stored ones."""
    array = random_image(3, 40, 24)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW" on display
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG", exif=exif)
    assert decode_image(out.getvalue(), 0, LIMITS).size == (40, 24)
    np.testing.assert_array_equal(np.asarray(decode_image(out.getvalue(), 0, LIMITS)), array)


@pytest.mark.parametrize("size", [(32, 32), (48, 40), (50, 37)])
def test_patch_rows_equal_a_conv2d_patch_embedding(size: tuple[int, int]) -> None:
    """The remainder below a patch (50 x 37 with P = 8) is dropped exactly as a stride-P conv drops it."""
    patch, dim = 8, 12
    rng = np.random.default_rng(0)
    pixels = rng.normal(size=(3, *size)).astype(np.float32)
    weight = torch.from_numpy(rng.normal(size=(dim, 3, patch, patch)).astype(np.float32))
    conv = torch.nn.functional.conv2d(torch.from_numpy(pixels)[None], weight, stride=patch)[0]
    expected = conv.flatten(1).T.numpy()  # [rows * cols, dim], row-major over the image
    rows = patch_rows(pixels, patch)
    assert rows.shape == ((size[0] // patch) * (size[1] // patch), 3 * patch * patch)
    np.testing.assert_allclose(rows @ weight.reshape(dim, -1).numpy().T, expected, atol=1e-4, rtol=1e-5)


def test_prepare_image_gives_the_vision_towers_rows(tmp_path: Path) -> None:
    processor, processing = _pair("siglip", tmp_path)
    data = png_bytes(random_image(4, 120, 80))
    rows, grid = prepare_image(data, 0, processing, LIMITS)
    ref, _ = _hf_output(processor, data)
    assert grid == (6, 6) and rows.shape == (36, 3 * 16 * 16) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, patch_rows(ref, 16), atol=1e-5, rtol=0)
    qwen, qwen_processing = _pair("qwen2-vl", tmp_path / "q")
    rows, grid = prepare_image(data, 0, qwen_processing, LIMITS)
    ref, ref_grid = _hf_output(qwen, data)
    assert grid == ref_grid and rows.shape == ref.shape


def test_no_preprocessor_config_means_no_images(tmp_path: Path) -> None:
    assert read_image_processing(tmp_path) is None


def test_patch_size_found_in_a_nested_vision_config(tmp_path: Path) -> None:
    """ColPali's config.json keeps the tower under vlm_config."""
    SiglipImageProcessor(size={"height": 448, "width": 448}).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vlm_config": {"vision_config": {"patch_size": 14}}}))
    assert read_image_processing(tmp_path).patch_size == 14


def _config(**keys) -> dict:
    return {"image_processor_type": "CLIPImageProcessor", **keys}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"image_processor_type": "Siglip2ImageProcessor", "do_resize": False}, "do_resize"),
        ({"image_processor_type": "Siglip2ImageProcessor", "max_num_patches": None}, "max_num_patches"),
        ({"image_processor_type": "LlavaNextImageProcessor"}, "not supported"),
        ({}, "not supported"),
        (_config(do_pad=True), "do_pad"),
        (_config(size={"max_height": 10, "max_width": 10}), "size"),
        (_config(crop_size={"shortest_edge": 3}), "crop_size"),
        (_config(resample=9), "resample"),
        (_config(resample="bicubic"), "resample"),
        (_config(resample=None), "resample is missing or null"),
        (_config(size=None), "size is missing or null"),
        ({"image_processor_type": "Qwen2VLImageProcessor", "merge_size": 0}, "merge_size"),
        ({"image_processor_type": "Qwen2VLImageProcessor", "size": 448}, "size"),
        (_config(image_mean=[0.5, 0.5]), "image_mean"),
        (_config(do_convert_rgb="no"), "do_convert_rgb"),
        (_config(do_normalize="yes"), "do_normalize"),
        (_config(do_reduce_labels=True), "do_reduce_labels"),
        ({"image_processor_type": "Qwen2VLImageProcessor", "do_resize": False}, "do_resize"),
        ({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 10, "max_pixels": 5}, "min_pixels"),
    ],
)
def test_what_cannot_be_reproduced_is_refused_at_start_up(raw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        processing_from_dict(raw, "model/preprocessor_config.json", 16)
    assert "model/preprocessor_config.json" in str(caught.value)


def test_a_patch_size_is_required(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(_config()))
    with pytest.raises(ValueError, match="patch_size"):
        read_image_processing(tmp_path)


def test_null_keys_stay_none_as_in_hf_and_inert_keys_pass() -> None:
    processing = processing_from_dict(
        _config(do_center_crop=None, processor_class="CLIPProcessor", feature_extractor_type="CLIPFeatureExtractor"),
        "p",
        32,
    )
    assert processing.resample == 3 and processing.crop is None and processing.resize == ("shortest_edge", 224)
    with pytest.raises(ValueError, match="p: image_mean is missing or null"):
        processing_from_dict(_config(image_mean=None), "p", 32)
    legacy = processing_from_dict(
        {"feature_extractor_type": "CLIPFeatureExtractor", "size": 224, "crop_size": 224}, "p", 32
    )
    assert legacy.resize == ("shortest_edge", 224) and legacy.crop == (224, 224)
    assert processing_from_dict(_config(do_convert_rgb=False), "p", 32) == processing_from_dict(_config(), "p", 32)
    square = processing_from_dict(_config(use_square_size=True), "p", 32)
    assert square.resize == ("fixed", 224, 224)


# preprocessor_config.json as published models ship them (CLIP ViT-B/32, PaliGemma 448 under ColPali, ColQwen2).
PUBLISHED = {
    "clip-openai": (
        {
            "crop_size": 224,
            "do_center_crop": True,
            "do_normalize": True,
            "do_resize": True,
            "feature_extractor_type": "CLIPFeatureExtractor",
            "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD),
            "resample": 3,
            "size": 224,
        },
        CLIPImageProcessor,
        32,
    ),
    "paligemma-448": (
        {
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "SiglipImageProcessor",
            "image_seq_length": 1024,
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "PaliGemmaProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 448, "width": 448},
        },
        SiglipImageProcessor,
        14,
    ),
    "siglip-nulls": (
        {
            "do_center_crop": None,
            "do_convert_rgb": None,
            "image_processor_type": "SiglipImageProcessor",
            "size": {"height": 64, "width": 80},
        },
        SiglipImageProcessor,
        16,
    ),
    "colqwen2": (
        {
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(CLIP_MEAN),
            "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": list(CLIP_STD),
            "max_pixels": 12845056,
            "merge_size": 2,
            "min_pixels": 3136,
            "patch_size": 14,
            "processor_class": "ColQwen2Processor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"max_pixels": 12845056, "min_pixels": 3136},
            "temporal_patch_size": 2,
        },
        Qwen2VLImageProcessor,
        14,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_equal_hf_loading_the_same_file(name: str, tmp_path: Path) -> None:
    """PaliGemma's file leaves do_convert_rgb null, which HF keeps as off (an RGBA page would fail there);
    ColPaliProcessor passes do_convert_rgb=True on every call, as the reference does here."""
    raw, cls, patch = PUBLISHED[name]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": patch}}))
    processor, processing = cls.from_pretrained(tmp_path), read_image_processing(tmp_path)
    for seed, (width, height) in enumerate([(300, 200), (64, 500)]):
        _check(processor, processing, jpeg_bytes(random_image(seed, width, height)))
        _check(processor, processing, png_bytes(random_image(seed, width, height, "RGBA")), do_convert_rgb=True)
