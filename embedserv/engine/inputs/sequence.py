"""One input ready for the scheduler: a text's token ids, or its images' patch rows with their placeholder ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InputSequence:
    """One input ready for the scheduler."""

    ids: list[int]
    # Tokens at the start that pooling skips (the prompt, when the model excludes it).
    pool_start: int = 0
    # Segment ids of a query/document pair, for models whose tokenizer feeds them; None means all zeros.
    token_type_ids: list[int] | None = None
    # The adapter its tokens run with: a task adapter's index in ModelInfo.task_adapters (jina-v3), or a --lora
    # adapter's in ModelInfo.lora_adapters; -1: the base weights.
    adapter: int = -1
    # Its images' patch rows [rows, patch_dim] float32, one image's after another, and one grid per image
    # (steps.ScheduledSequence.pixels); else None.
    pixels: np.ndarray | None = None
    image_grids: tuple[tuple[int, ...], ...] = ()
