"""The image inputs of a step: every image sequence's patch rows (steps.ScheduledSequence.pixels) in the
step's packed sequence order (a sequence's images in its own order), in one float32 buffer that crosses to the
device in one copy, with their own offsets: the vision tower's attention metadata (bidirectional, one sequence per
image, or per frame of an image whose grid is (frames, h, w): Qwen2-VL attends each temporal frame alone,
ColModernVBERT each tile), and for a tower with windowed attention (Qwen2.5-VL: models/vision_windows.py) the
windows' metadata too. The grids go to the model flat, one per image, in the same order.

Dual encoders (CLIP, SigLIP) take the rows as the sequences' tokens, so they line up with the token rows
(padded alike on CPU); vision-language models (ColPali, ColQwen2) run them through the vision tower and place
the result at the image's placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from embedserv.attention.metadata import CommonAttentionMetadata, build_common_metadata, cumulative_offsets
from embedserv.models.vision_windows import VisionWindows
from embedserv.steps import ScheduledSequence


@dataclass(frozen=True)
class ImageInputs:
    # [rows, patch_dim] float32: the image sequences' patch rows in packed order (padded like the token rows
    # on CPU).
    pixel_values: torch.Tensor
    # Each image's grid, in the same order (the towers that need them: Qwen2-VL's, SigLIP 2's).
    grids: tuple[tuple[int, ...], ...]
    # The vision tower's metadata.
    attention: CommonAttentionMetadata
    # Its windowed layers' (one sequence per window, rows in the tower's window order); None: it has none.
    windows: CommonAttentionMetadata | None = None


def image_rows(num_rows: int, grids: tuple[tuple[int, ...], ...]) -> list[int]:
    """How many of a sequence's `num_rows` pixel rows each of its images (`grids`) has: all of them for one image
    (a dual encoder's class-token row included); for several, each grid's t * h * w
    (steps.ScheduledSequence.image_grids)."""
    if len(grids) == 1:
        return [num_rows]
    counts = [int(np.prod(grid)) for grid in grids]
    if any(len(grid) != 3 for grid in grids) or sum(counts) != num_rows:
        raise ValueError(
            f"a sequence of {num_rows} pixel rows holds several images whose grids {grids} are not (t, h, w) grids "
            "of that many rows"
        )
    return counts


def frame_lengths(rows: list[int], grids: list[tuple[int, ...]]) -> np.ndarray:
    """The vision tower's sequences: each image's `rows`, split into its frames when its grid is (frames, h, w)."""
    lens: list[int] = []
    for count, grid in zip(rows, grids, strict=True):
        frames = grid[0] if len(grid) == 3 else 1
        if frames < 1 or count % frames:
            raise ValueError(f"an image of {count} rows does not split into the {frames} frames of its grid {grid}")
        lens.extend([count // frames] * frames)
    return np.asarray(lens, dtype=np.int64)


class ImagePlan:
    def __init__(
        self,
        seqs: list[ScheduledSequence],
        order: np.ndarray,
        padded: Callable[[int], int],
        parts: dict,
        windows: VisionWindows | None = None,
    ) -> None:
        members = [seqs[i] for i in order if seqs[i].pixels is not None]
        self.grids = tuple(grid for s in members for grid in s.image_grids)
        self.lens = frame_lengths(
            [n for s in members for n in image_rows(len(s.pixels), s.image_grids)], list(self.grids)
        )
        self.window_lens = windows.lengths(self.grids) if windows is not None else None
        if self.window_lens is not None:
            parts["image_window_cu_seqlens"] = cumulative_offsets(self.window_lens)
        rows = np.concatenate([s.pixels for s in members]).astype(np.float32, copy=False)
        padding = padded(len(rows)) - len(rows)
        if padding > 0:
            rows = np.concatenate((rows, np.zeros((padding, rows.shape[1]), dtype=np.float32)))
        self.rows = rows
        # The offsets travel with the step's other integers (input_builder.to_device).
        parts["image_cu_seqlens"] = cumulative_offsets(self.lens)

    def inputs(self, device_parts: dict, device: torch.device) -> ImageInputs:
        host = torch.from_numpy(np.ascontiguousarray(self.rows))
        pixels = host.pin_memory().to(device, non_blocking=True) if device.type != "cpu" else host
        attention = build_common_metadata(self.lens, False, cu_seqlens=device_parts["image_cu_seqlens"])
        windows = None
        if self.window_lens is not None:
            cu = device_parts["image_window_cu_seqlens"]
            windows = build_common_metadata(self.window_lens, False, cu_seqlens=cu)
        return ImageInputs(pixels, self.grids, attention, windows)
