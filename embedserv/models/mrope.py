"""M-RoPE positions (Qwen2-VL's multimodal rotary positions): three per token, (temporal, height, width).

Text tokens advance all three together, one per token. An image's placeholder tokens (one per merged patch:
t * (h / merge) * (w / merge) of them for a grid (t, h, w) in patches) take the image's own grid: each token
(start + frame, start + row, start + column) in the tower's token order (frames, then rows, then columns),
where start is where the image begins; the text after it continues from start + max(h, w) / merge, one past
the image's largest spatial position. This is transformers' Qwen2VLModel.get_rope_index (5.x: it groups
tokens by `mm_token_type_ids`, the image placeholders' runs, and steps on by max(h, w) // merge after each
image). One difference, on inputs it refuses: two images whose placeholders touch (no text between) are one
run there, which fails; here the run is cut by the grids' token counts, each image starting anew.

Numpy only (no torch): the worker's input builder calls it per sequence on the host, each sequence counting
from its own 0 (packed batches do not share positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MRopeSpec:
    """What a model that rotates by M-RoPE tells the input builder: the image placeholder token and the
    vision tower's spatial merge (an image's grid is in patches; its tokens are merge x merge blocks)."""

    image_token_id: int
    spatial_merge_size: int


def image_token_count(grid: Sequence[int], merge: int) -> int:
    """Language-model tokens of an image whose grid in patches is (t, h, w)."""
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def _grid_positions(grid: Sequence[int], merge: int, start: int) -> np.ndarray:
    """[3, tokens] int64: an image's (frame, row, column) per token from `start`, frames slowest."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    frames, rows, columns = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack((frames.ravel(), rows.ravel(), columns.ravel())).astype(np.int64) + start


def mrope_positions(
    token_ids: Sequence[int] | np.ndarray, image_grids: Sequence[Sequence[int]], merge: int, image_token_id: int
) -> np.ndarray:
    """[3, len(token_ids)] int64 positions of one sequence from 0; `image_grids`: its images' (t, h, w) in
    order, one per run of `t * h * w / merge**2` placeholder tokens."""
    ids = np.asarray(token_ids, dtype=np.int64)
    is_image = ids == image_token_id
    counts = [image_token_count(grid, merge) for grid in image_grids]
    if int(is_image.sum()) != sum(counts):
        raise ValueError(
            f"{int(is_image.sum())} image tokens in the sequence but its {len(counts)} image grids give {sum(counts)}"
        )
    out = np.empty((3, len(ids)), dtype=np.int64)
    if not counts:
        out[:] = np.arange(len(ids), dtype=np.int64)
        return out
    # Where each run of text or image tokens starts, and whether it is an image run.
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    starts = np.concatenate(([0], edges)).tolist()
    ends = [*starts[1:], len(ids)]
    grids = iter(zip(image_grids, counts, strict=True))
    current = 0
    for begin, end in zip(starts, ends, strict=True):
        if not is_image[begin]:
            out[:, begin:end] = np.arange(current, current + end - begin, dtype=np.int64)
            current += end - begin
            continue
        at = begin
        while at < end:
            grid, count = next(grids)
            if at + count > end:
                raise ValueError(f"an image of grid {tuple(grid)} needs {count} tokens; its run has {end - at}")
            out[:, at : at + count] = _grid_positions(grid, merge, current)
            current += max(grid[1], grid[2]) // merge
            at += count
    return out


def packed_mrope_positions(
    sequences: Sequence[tuple[Sequence[int], Sequence[Sequence[int]], int]], spec: MRopeSpec
) -> np.ndarray:
    """[3, total tokens] for sequences packed one after another, each (token ids, image grids, start position):
    its positions from 0, shifted by `start` (tokens already computed). A sequence with images must start at 0,
    since its positions depend on the tokens before; text-only ones continue anywhere (all three rows equal)."""
    parts = []
    for ids, grids, start in sequences:
        if grids and start:
            raise ValueError(f"an M-RoPE sequence with images runs whole in one step; this one starts at {start}")
        parts.append(mrope_positions(ids, grids, spec.spatial_merge_size, spec.image_token_id) + start)
    return np.concatenate(parts, axis=1) if parts else np.empty((3, 0), dtype=np.int64)
