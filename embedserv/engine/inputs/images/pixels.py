"""One decoded RGB image -> exactly what its HF image processor returns for it, and the vision tower's rows.

The steps and their dtypes follow transformers' PIL backend: resize with Pillow on uint8, center crop (zero
padding when the image is smaller), rescale in float64 then float32, normalize in float32.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from embedserv.engine.inputs.images.decode import ImageLimits, decode_image, to_rgb
from embedserv.engine.inputs.images.idefics3 import idefics3_frames
from embedserv.engine.inputs.images.processing import ImageProcessing


def pixel_values(image: Image.Image, processing: ImageProcessing) -> tuple[np.ndarray, tuple[int, ...]]:
    """CLIP/SigLIP: ([3, H, W] float32, (H // patch, W // patch)); Qwen2-VL: ([N, 3 * t * p * p] float32,
    (t, h, w)) as image_grid_thw; SigLIP2: its patches without the padding ([h * w, p * p * 3], the rows of
    pixel_values[0] where pixel_attention_mask is 1) and (h, w) as spatial_shapes; Idefics3: [frames, 3, M, M] float32
    (the tiles and the global image, images/idefics3.py) and the tiles' (rows, cols). `image` is normally
    decode_image's output; another mode is converted as HF does."""
    if image.mode != "RGB":
        image = to_rgb(image)
    if processing.layout == "qwen2_vl":
        return _qwen2_vl(image, processing)
    if processing.layout == "siglip2":
        return _siglip2(image, processing)
    if processing.layout == "idefics3":
        frames, tiles = idefics3_frames(image, processing)
        return _rescale_normalize(frames, processing), tiles
    if processing.resize is not None:
        image = _resize(image, _target_size(image.size, processing.resize), processing.resample)
    chw = np.moveaxis(np.asarray(image), -1, 0)
    if processing.crop is not None:
        chw = center_crop(chw, *processing.crop)
    pixels = _rescale_normalize(chw, processing)
    return pixels, (pixels.shape[1] // processing.patch_size, pixels.shape[2] // processing.patch_size)


def patch_rows(pixels_chw: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, H, W] -> [(H // P) * (W // P), C * P * P]: patches row-major over the image, each flattened in
    (channel, row, column) order, so rows @ conv.weight.reshape(D, -1).T is conv2d(stride=P) flattened; like the
    conv, a remainder below P at the right or bottom is dropped."""
    channels, height, width = pixels_chw.shape
    rows, cols = height // patch_size, width // patch_size
    cropped = pixels_chw[:, : rows * patch_size, : cols * patch_size]
    patches = cropped.reshape(channels, rows, patch_size, cols, patch_size).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(patches.reshape(rows * cols, channels * patch_size * patch_size))


def prepare_image(
    data: bytes, index: int | str, processing: ImageProcessing, limits: ImageLimits
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Decode and preprocess one input: the rows its vision tower takes ([rows, patch_dim] float32) and its grid
    (CLIP/SigLIP: conv patch rows, see patch_rows; Qwen2-VL and SigLIP2: the processor's own patch rows; Idefics3:
    each frame's conv patch rows in turn, and the tiles' (rows, cols))."""
    values, grid = pixel_values(decode_image(data, index, limits), processing)
    if processing.layout == "idefics3":
        return np.concatenate([patch_rows(frame, processing.patch_size) for frame in values]), grid
    if processing.layout != "chw":
        return values, grid
    return patch_rows(values, processing.patch_size), grid


def center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop: a smaller image is centred on zeros first."""
    _, orig_h, orig_w = chw.shape
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return chw[:, top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((chw.shape[0], new_h, new_w), dtype=chw.dtype)
    pad_top, pad_left = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[:, pad_top : pad_top + orig_h, pad_left : pad_left + orig_w] = chw
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of `factor`, pixel count within [min_pixels, max_pixels]."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _target_size(size: tuple[int, int], rule: tuple) -> tuple[int, int]:
    """(height, width) after resizing, as transformers computes it (int() truncation included)."""
    width, height = size
    if rule[0] == "fixed":
        return rule[1], rule[2]
    if rule[0] == "shortest_edge":
        short, long = min(width, height), max(width, height)
        new_short, new_long = rule[1], int(rule[1] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    return _shortest_longest(height, width, rule[1], rule[2])


def _shortest_longest(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' get_size_with_aspect_ratio."""
    raw = None
    low, high = float(min(height, width)), float(max(height, width))
    if high / low * size > max_size:
        raw = max_size * low / high
        size = round(raw)
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    scale = raw if raw is not None else size
    if width < height:
        return int(scale * height / width), size
    return size, int(scale * width / height)


def _resize(image: Image.Image, hw: tuple[int, int], resample: int) -> Image.Image:
    return image.resize((hw[1], hw[0]), resample=resample)


def _rescale_normalize(chw: np.ndarray, processing: ImageProcessing) -> np.ndarray:
    """[3, H, W] (or [frames, 3, H, W]) uint8 -> float32."""
    pixels = chw
    if processing.rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    if processing.image_mean is not None:
        pixels = pixels.astype(np.float32, copy=False)
        mean = np.asarray(processing.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(processing.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels, dtype=np.float32)


def _qwen2_vl(image: Image.Image, processing: ImageProcessing) -> tuple[np.ndarray, tuple[int, ...]]:
    """Qwen2VLImageProcessor: smart_resize, rescale, normalize, then patches in the merger's order."""
    patch, merge, temporal = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    _, low, high = processing.resize
    height, width = smart_resize(image.height, image.width, patch * merge, low, high)
    chw = np.moveaxis(np.asarray(_resize(image, (height, width), processing.resample)), -1, 0)
    pixels = _rescale_normalize(chw, processing)
    grid_h, grid_w = height // patch, width // patch
    patches = pixels.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, patch, patch))
    rows = patches.reshape(grid_h * grid_w, 3 * temporal * patch * patch)
    return np.ascontiguousarray(rows, dtype=np.float32), (1, grid_h, grid_w)


def siglip2_size(height: int, width: int, patch: int, max_num_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """SigLIP2's get_image_size_for_max_num_patches: the scale found by its binary search, sides rounded up to
    whole patches (at least one)."""

    def scaled(scale: float, size: int) -> int:
        return max(patch, math.ceil(size * scale / patch) * patch)

    low, high = eps / 10, 100.0
    while high - low >= eps:
        scale = (low + high) / 2
        if (scaled(scale, height) / patch) * (scaled(scale, width) / patch) <= max_num_patches:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


def _siglip2(image: Image.Image, processing: ImageProcessing) -> tuple[np.ndarray, tuple[int, ...]]:
    patch = processing.patch_size
    height, width = siglip2_size(image.height, image.width, patch, processing.max_num_patches)
    chw = np.moveaxis(np.asarray(_resize(image, (height, width), processing.resample)), -1, 0)
    pixels = _rescale_normalize(chw, processing)
    rows, cols = height // patch, width // patch
    patches = pixels.reshape(3, rows, patch, cols, patch).transpose(1, 3, 2, 4, 0)
    return np.ascontiguousarray(patches.reshape(rows * cols, -1)), (rows, cols)
