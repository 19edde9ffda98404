"""Qwen2.5-VL's vision windows: most blocks of its vision tower attend within square windows of merge blocks
instead of the whole image (models/families/qwen2_5_vision.py).

An image of grid (t, h, w) in patches has (h / merge) x (w / merge) merge blocks per frame; windows are
`window_size / merge / patch_size` blocks on a side, laid from the top left (the last row and column of windows
cut short where the blocks run out). The tower reorders its rows so that each window's blocks are contiguous
(window by window, row-major within a window) and the windowed blocks attend within each window; the rest
within each frame. This is transformers' get_vision_window_index.

Numpy only (no torch): the worker's input builder asks for the windows' lengths on the host, and the tower for
the order, both from the step's image grids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionWindows:
    """What a tower with windowed attention tells the input builder: its windows' side in pixels, its patch
    size and spatial merge."""

    window_size: int
    patch_size: int
    spatial_merge_size: int

    @property
    def blocks_per_side(self) -> int:
        return self.window_size // self.spatial_merge_size // self.patch_size

    def _windows(self, grid: Sequence[int]) -> list[np.ndarray]:
        """One image's windows: each the merge-block indices (from 0, frames in order) it holds, in order."""
        t, h, w = (int(v) for v in grid)
        h, w, side = h // self.spatial_merge_size, w // self.spatial_merge_size, self.blocks_per_side
        blocks = np.arange(t * h * w).reshape(t, h, w)
        return [
            blocks[frame, top : top + side, left : left + side].ravel()
            for frame in range(t)
            for top in range(0, h, side)
            for left in range(0, w, side)
        ]

    def order(self, grids: Sequence[Sequence[int]]) -> np.ndarray:
        """[merge blocks] int64: for the images in order, which merge block (in the processor's order, counted
        across the images) comes at each place of the window order."""
        parts, start = [], 0
        for grid in grids:
            windows = self._windows(grid)
            parts.extend(window + start for window in windows)
            start += sum(len(window) for window in windows)
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def lengths(self, grids: Sequence[Sequence[int]]) -> np.ndarray:
        """[windows] int64: each window's rows (patches: merge ** 2 per block), the images in order."""
        unit = self.spatial_merge_size**2
        return np.asarray([len(w) * unit for grid in grids for w in self._windows(grid)], dtype=np.int64)
