"""Idefics3's image processing (ColModernVBERT's pages) against transformers' Idefics3ImageProcessorPil: the same
frames (tiles row-major, then the global image) and the same tile rows and cols, for images of many sizes and
aspect ratios, with splitting on and off, a fixed resize and no resize."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.engine.inputs.images import pixel_values
from embedserv.engine.inputs.images.processing import processing_from_dict

# (height, width): small, square, wide, tall, exactly one tile, past the first resize's edge.
SIZES = ((20, 30), (32, 32), (33, 31), (40, 130), (130, 40), (64, 96), (97, 23), (200, 150), (9, 250))
SETTINGS = {
    "split": {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}},
    "split_bicubic_unnormalized": {
        "size": {"longest_edge": 128},
        "max_image_size": {"longest_edge": 48},
        "resample": 3,
        "do_normalize": False,
    },
    "no_split": {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}, "do_image_splitting": False},
    "no_resize": {"do_resize": False, "max_image_size": {"longest_edge": 32}},
    "fixed": {"size": {"height": 70, "width": 50}, "max_image_size": {"longest_edge": 32}},
}


def _image(height: int, width: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_frames_and_tiles_equal_transformers(name, tmp_path):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    reference = Idefics3ImageProcessorPil(**SETTINGS[name])
    reference.save_pretrained(str(tmp_path))
    import json

    raw = json.loads((tmp_path / "preprocessor_config.json").read_text())
    ours = processing_from_dict(raw, tmp_path / "preprocessor_config.json", model_patch=16)
    for seed, (height, width) in enumerate(SIZES):
        image = _image(height, width, seed)
        expected = reference(images=[image], return_row_col_info=True, return_tensors="np")
        frames, tiles = pixel_values(image, ours)
        assert tiles == (expected["rows"][0][0], expected["cols"][0][0]), (height, width)
        np.testing.assert_array_equal(frames, expected["pixel_values"][0], err_msg=f"{height}x{width}")


def test_a_max_image_size_other_than_longest_edge_is_refused():
    raw = {"image_processor_type": "Idefics3ImageProcessor", "max_image_size": {"height": 32, "width": 32}}
    with pytest.raises(ValueError, match="max_image_size"):
        processing_from_dict(raw, "preprocessor_config.json", model_patch=16)
