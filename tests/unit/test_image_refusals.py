"""Every image the server refuses is an ImageError (INVALID_ARGUMENT / 400) naming the input and what to change,
raised before anything large is allocated; a fuzz of hostile bytes raises nothing else and finishes quickly."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image, ImageFile

from embedserv.engine.inputs.images import (
    MIN_SIDE,
    ImageError,
    ImageLimits,
    decode_image,
    pixel_values,
)
from embedserv.engine.inputs.images.processing import processing_from_dict
from embedserv.errors import InvalidInput
from tests.helpers.images import (
    huge_jpeg_header,
    huge_png_header,
    jpeg_bytes,
    png_bytes,
    random_image,
    truncated_png,
    webp_bytes,
)

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=4_000_000)


def _refused(data: bytes, index: int = 3, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(ImageError) as caught:
        decode_image(data, index, limits)
    message = str(caught.value)
    assert message.startswith(f"input {index}"), message
    return message


def test_an_image_error_is_invalid_input() -> None:
    assert issubclass(ImageError, InvalidInput)


def test_too_many_bytes_is_refused_before_anything_else() -> None:
    message = _refused(b"not even an image" * 100, limits=ImageLimits(max_bytes=1000, max_pixels=10**6))
    assert "1700 bytes" in message and "limit of 1000 bytes" in message


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO", "PPM"])
def test_formats_other_than_png_jpeg_webp_are_refused(fmt: str) -> None:
    out = io.BytesIO()
    Image.fromarray(random_image(0, 32, 32)).save(out, format=fmt)
    assert _refused(out.getvalue(), 2) == "input 2 is not a PNG, JPEG or WebP image; convert it to one of those formats"


@pytest.mark.parametrize("data", [b'<svg xmlns="http://www.w3.org/2000/svg"/>', b"hello", b"", b"RIFF\0\0\0\0WAVE"])
def test_svg_text_and_empty_are_refused(data: bytes) -> None:
    assert "is not a PNG, JPEG or WebP image" in _refused(data)


def test_a_huge_png_is_refused_from_its_header_without_decoding() -> None:
    data = huge_png_header(20000, 20000)
    assert len(data) < 100
    start = time.perf_counter()
    message = _refused(data, limits=ImageLimits(max_bytes=1 << 20, max_pixels=40_000_000))
    assert time.perf_counter() - start < 0.5
    assert "400000000 pixels" in message and "limit is 40000000 pixels" in message


def test_a_huge_jpeg_is_refused_from_its_header() -> None:
    start = time.perf_counter()
    message = _refused(huge_jpeg_header(60000, 30000), limits=ImageLimits(max_bytes=1 << 20, max_pixels=40_000_000))
    assert time.perf_counter() - start < 0.5 and "pixels" in message and "40000000" in message
    assert "3000x2000 = 6000000 pixels" in _refused(huge_jpeg_header(3000, 2000))


def test_a_non_rgb_image_given_straight_to_pixel_values_is_converted_as_hf_does() -> None:
    processing = processing_from_dict({"image_processor_type": "SiglipImageProcessor"}, "p", 16)
    rgba = Image.fromarray(random_image(1, 30, 20, "RGBA"))
    converted = decode_image(png_bytes(rgba), 0, LIMITS)
    np.testing.assert_array_equal(pixel_values(rgba, processing)[0], pixel_values(converted, processing)[0])


def test_pillows_own_bomb_threshold_is_a_refusal_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above Image.MAX_IMAGE_PIXELS Pillow warns (above twice it raises): both are ImageErrors here."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert "limit of 1000 pixels" in _refused(png_bytes(random_image(0, 40, 40)))
    assert "3600 pixels" in _refused(png_bytes(random_image(0, 60, 60)))


def test_a_server_limit_above_pillows_warning_still_stops_at_pillows_threshold() -> None:
    """96M pixels: over Pillow's MAX_IMAGE_PIXELS (89M, where it only warns), under its 2x error."""
    limits = ImageLimits(max_bytes=1 << 20, max_pixels=300_000_000)
    message = _refused(huge_png_header(12000, 8000), limits=limits)
    assert "12000x8000 = 96000000 pixels" in message and f"limit of {Image.MAX_IMAGE_PIXELS} pixels" in message


@pytest.mark.parametrize(("width", "height"), [(1, 1), (MIN_SIDE - 1, 64), (64, 2)])
def test_too_small_is_refused_with_the_minimum(width: int, height: int) -> None:
    message = _refused(png_bytes(random_image(0, width, height)))
    assert f"{width}x{height}" in message and f"at least {MIN_SIDE} pixels" in message


def test_the_smallest_allowed_image_decodes() -> None:
    assert decode_image(png_bytes(random_image(0, MIN_SIDE, MIN_SIDE)), 0, LIMITS).size == (MIN_SIDE, MIN_SIDE)


def test_an_extreme_aspect_ratio_is_refused() -> None:
    assert "at most 200 times its shorter side" in _refused(png_bytes(random_image(0, 8 * 201, 8)))
    assert decode_image(png_bytes(random_image(0, 8 * 200, 8)), 0, LIMITS).size == (1600, 8)


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.9, 0.99])
def test_a_truncated_png_is_refused(keep: float) -> None:
    message = _refused(truncated_png(keep=keep))
    assert "truncated or corrupt" in message or "header cannot be read" in message


@pytest.mark.parametrize("encode", [jpeg_bytes, webp_bytes])
def test_truncated_jpeg_and_webp_are_refused(encode) -> None:
    data = encode(random_image(1, 64, 64))
    message = _refused(data[: len(data) // 2])
    assert "truncated or corrupt" in message or "header cannot be read" in message


def test_truncated_images_are_never_loaded_as_grey(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_image(png_bytes(random_image(0, 16, 16)), 0, LIMITS)


def test_a_valid_image_decodes_to_its_pixels() -> None:
    array = random_image(2, 33, 21)
    image = decode_image(png_bytes(array), 0, LIMITS)
    assert image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), array)


def _fuzz_cases(rng: np.random.Generator) -> list[bytes]:
    """Random bytes, valid headers followed by garbage, truncations and flipped bytes of valid files."""
    valid = [
        png_bytes(random_image(0, 24, 16)),
        jpeg_bytes(random_image(1, 24, 16)),
        webp_bytes(random_image(2, 24, 16)),
        webp_bytes(random_image(3, 24, 16), lossless=False),
        png_bytes(random_image(4, 24, 16, "RGBA")),
        png_bytes(Image.fromarray(random_image(5, 24, 16)).quantize()),
    ]
    cases = []
    for i in range(2000):
        source = valid[i % len(valid)]
        kind = i % 4
        if kind == 0:
            cases.append(rng.bytes(int(rng.integers(0, 400))))
        elif kind == 1:
            cases.append(source[: int(rng.integers(8, 60))] + rng.bytes(int(rng.integers(0, 300))))
        elif kind == 2:
            cases.append(source[: int(rng.integers(0, len(source)))])
        else:
            flipped = bytearray(source)
            for at in rng.integers(0, len(flipped), int(rng.integers(1, 8))):
                flipped[at] = int(rng.integers(0, 256))
            cases.append(bytes(flipped))
    return cases


def test_fuzz_raises_only_image_errors_and_finishes_quickly() -> None:
    rng = np.random.default_rng(37)
    decoded = refused = 0
    slowest = 0.0
    for data in _fuzz_cases(rng):
        start = time.perf_counter()
        try:
            image = decode_image(data, 0, LIMITS)
        except ImageError as e:
            assert str(e).startswith("input 0")
            refused += 1
        else:
            assert image.mode == "RGB" and image.width * image.height <= LIMITS.max_pixels
            decoded += 1
        slowest = max(slowest, time.perf_counter() - start)
    assert refused > 1000 and decoded > 10  # the fuzz reaches both outcomes
    assert slowest < 1.0, f"one case took {slowest:.2f} s"
