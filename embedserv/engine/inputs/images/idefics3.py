"""Idefics3's image processor (ColModernVBERT's), as transformers 5's Idefics3ImageProcessorPil runs it on one image.

1. Resize (do_resize): the longest edge to size's longest_edge, the other by the aspect ratio (int(), then made
   even), both capped at 4096; or to a fixed height and width.
2. With do_image_splitting: resize both sides up to multiples of the tile side M (max_image_size's longest_edge),
   the height from the new width when the image is wide (and the width from the new height when tall), as
   `resize_for_vision_encoder` does; an image bigger than M x M is then cut into its rows x cols tiles of M x M
   (row-major) and followed by the whole image resized to M x M (the global image); an M x M one stays one frame
   (rows = cols = 0). Without splitting, the image is resized to M x M (rows = cols = 0).
3. Rescale and normalize every frame (pixels.py). Padding (do_pad) changes nothing: every frame is M x M.

Every resize is Pillow's on the uint8 image with the processor's filter (LANCZOS by default), as the PIL backend's
np_resize is.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from embedserv.engine.inputs.images.processing import ImageProcessing

# transformers' MAX_IMAGE_SIZE: no side is resized past this.
MAX_SIDE = 4096


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """_resize_output_size_rescale_to_max_len, then _resize_output_size_scale_below_upper_bound."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """resize_for_vision_encoder's target: both sides multiples of `tile`."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def idefics3_frames(image: Image.Image, processing: ImageProcessing) -> tuple[np.ndarray, tuple[int, int]]:
    """([frames, 3, M, M] uint8: the tiles row-major, then the global image; or the one frame) and (rows, cols)
    of the tiles, (0, 0) when the image is one frame."""
    tile = processing.tile_size
    if processing.resize is not None:
        rule = processing.resize
        size = longest_edge_size(image.height, image.width, rule[1]) if rule[0] == "longest_edge" else rule[1:]
        image = _resize(image, size, processing.resample)
    if not processing.split_tiles:
        frames, rows, cols = [_resize(image, (tile, tile), processing.resample)], 0, 0
    else:
        image = _resize(image, tiled_size(image.height, image.width, tile), processing.resample)
        if image.height > tile or image.width > tile:
            rows, cols = image.height // tile, image.width // tile
            pixels = np.asarray(image)
            frames = [
                pixels[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile] for r in range(rows) for c in range(cols)
            ]
            frames.append(_resize(image, (tile, tile), processing.resample))
        else:
            frames, rows, cols = [image], 0, 0
    return np.stack([np.moveaxis(np.asarray(frame), -1, 0) for frame in frames]), (rows, cols)


def _resize(image: Image.Image, size, resample: int) -> Image.Image:
    height, width = size
    return image.resize((width, height), resample=resample)
