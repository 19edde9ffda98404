"""Encoded bytes -> a fully loaded RGB Pillow image, refusing anything too big, too small, unknown or corrupt."""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageFile

from embedserv.errors import InvalidInput

# Narrower sides carry nothing a vision tower can read, and resizing such strips takes extreme ratios.
MIN_SIDE = 8
# Qwen2-VL's smart_resize refuses a longer side over 200 times the shorter; one bound for every model keeps a thin
# strip from being upscaled into a huge array by a shortest-edge resize.
MAX_ASPECT_RATIO = 200
_FORMATS = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}


class ImageError(InvalidInput):
    """An image input the server refuses; the message names the input and what to change."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int


def image_format(data: bytes) -> str | None:
    """PNG, JPEG or WEBP by the magic bytes, else None: Pillow's other decoders are never reached."""
    for name, magic in _FORMATS.items():
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def decode_image(data: bytes, index: int | str, limits: ImageLimits) -> Image.Image:
    """The image in `data`, decoded and converted to RGB; ImageError naming input `index` when refused (an input's
    number, or "N (image k)" for an interleaved input's images)."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on: truncated images would decode as grey")
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"input {index}: the image has {len(data)} bytes, over this server's limit of "
            f"{limits.max_bytes} bytes per image; send a smaller or more compressed image"
        )
    kind = image_format(data)
    if kind is None:
        raise ImageError(f"input {index} is not a PNG, JPEG or WebP image; convert it to one of those formats")
    image = _open(data, index, kind, limits)
    _check_size(image.size, index, limits)
    try:
        image.load()
        return to_rgb(image)
    except Exception as e:
        raise ImageError(
            f"input {index}: the {kind} image is truncated or corrupt and cannot be decoded ({e}); "
            f"send the complete file"
        ) from None


def _open(data: bytes, index: int | str, kind: str, limits: ImageLimits) -> Image.Image:
    """Reads the header only (Image.open is lazy); the pixels are not decoded yet."""
    try:
        return Image.open(io.BytesIO(data), formats=[kind])
    except Image.DecompressionBombError as e:  # Pillow's own ceiling, twice MAX_IMAGE_PIXELS: its message has the size
        raise ImageError(
            f"input {index}: the image has too many pixels ({e}); this server's limit is "
            f"{limits.max_pixels} pixels per image; downscale it"
        ) from None
    except Exception as e:
        raise ImageError(
            f"input {index}: the {kind} image's header cannot be read ({e}); send a valid PNG, JPEG or WebP file"
        ) from None


def _check_size(size: tuple[int, int], index: int | str, limits: ImageLimits) -> None:
    width, height = size
    # Pillow warns above MAX_IMAGE_PIXELS: that is a refusal here too (a warning cannot be caught thread-safely).
    bomb = Image.MAX_IMAGE_PIXELS or width * height
    if width * height > min(limits.max_pixels, bomb):
        raise ImageError(
            f"input {index}: the image is {width}x{height} = {width * height} pixels, over this "
            f"server's limit of {min(limits.max_pixels, bomb)} pixels per image; downscale it"
        )
    if min(width, height) < MIN_SIDE:
        raise ImageError(
            f"input {index}: the image is {width}x{height} pixels; each side must be at least {MIN_SIDE} pixels"
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(
            f"input {index}: the image is {width}x{height} pixels; its longer side may be at most "
            f"{MAX_ASPECT_RATIO} times its shorter side; crop or pad it"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' convert_to_rgb does it: transparency is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
