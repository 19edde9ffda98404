"""Images built inside tests (nothing downloaded): encoded PNG / JPEG / WebP bytes from numpy arrays, seeded random
pictures, and hostile files (a PNG header claiming a huge size, a truncated PNG)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def random_image(seed: int, width: int, height: int, mode: str = "RGB") -> np.ndarray:
    """A smooth-ish random picture [height, width, channels] uint8 (gradients plus noise, so resampling and JPEG
    have real work to do); mode "RGB", "RGBA" or "L" ([height, width])."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    ys, xs = np.mgrid[0:height, 0:width]
    base = (xs[..., None] * rng.uniform(0.5, 3, channels) + ys[..., None] * rng.uniform(0.5, 3, channels)) % 256
    noisy = base + rng.normal(0, 24, (height, width, channels))
    array = np.clip(noisy, 0, 255).astype(np.uint8)
    return array[..., 0] if mode == "L" else array


def _encode(array: np.ndarray | Image.Image, fmt: str, **options) -> bytes:
    image = array if isinstance(array, Image.Image) else Image.fromarray(array)
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def png_bytes(array: np.ndarray | Image.Image) -> bytes:
    """Lossless: decoding gives `array` back."""
    return _encode(array, "PNG")


def jpeg_bytes(array: np.ndarray | Image.Image, quality: int = 90) -> bytes:
    return _encode(array, "JPEG", quality=quality)


def webp_bytes(array: np.ndarray | Image.Image, lossless: bool = True, quality: int = 90) -> bytes:
    return _encode(array, "WEBP", lossless=lossless, quality=quality)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def huge_png_header(width: int, height: int) -> bytes:
    """A valid-looking PNG whose IHDR claims width x height (8-bit RGB) followed by a tiny IDAT: a few dozen bytes,
    so a test of the pixel limit runs instantly and allocates nothing if the server refuses it before decoding."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def truncated_png(seed: int = 0, width: int = 64, height: int = 48, keep: float = 0.5) -> bytes:
    """A real PNG cut after `keep` of its bytes: its header reads, its pixels do not."""
    data = png_bytes(random_image(seed, width, height))
    return data[: int(len(data) * keep)]


def huge_jpeg_header(width: int, height: int) -> bytes:
    """A small real JPEG whose frame header (SOF0) is rewritten to claim width x height: refused from the header."""
    data = bytearray(jpeg_bytes(random_image(0, 16, 16)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)
