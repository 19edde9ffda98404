"""Compact encodings of dense vectors, as sentence-transformers' quantize_embeddings computes them.

- float16: the float32 values cast.
- binary / ubinary: one bit per dimension (value > 0), packed 8 to a byte, most significant bit first
  (numpy's packbits); binary subtracts 128 and sends the bytes as int8.
- int8 / uint8: each value's bucket of 256 between a per-dimension minimum and maximum (uint8), minus 128
  (int8). The ranges belong to the model, never to the batch: they are computed once per model, on the
  first int8 / uint8 request, from the built-in calibration texts (calibration.txt beside this file),
  embedded as that request's dimensions and normalization would embed them; so a text gets the same bytes
  alone or in any batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import numpy as np

from embedserv.engine.tasks.outputs import finish_embeddings
from embedserv.types import EmbedOutput, EmbedParams, EmbedResult, Encoding

# The encodings that need the model's per-dimension ranges.
RANGED = (Encoding.INT8, Encoding.UINT8)
CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")
# Texts embedded at once while calibrating (the scheduler batches them under its own token budget).
_CALIBRATION_BATCH = 64


def calibration_texts() -> list[str]:
    """The built-in calibration texts: one per line, after the header's '#' lines."""
    lines = CALIBRATION_FILE.read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def ranges_of(rows: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[2, dim] float32: per-dimension minimum and maximum of the calibration vectors, finished as a request
    with these dimensions and normalization finishes its vectors."""
    # A copy: finish_embeddings normalizes a float32 array in place when it keeps every dimension, and these
    # rows are the model's cached calibration vectors.
    finished = finish_embeddings(rows.copy(), dimensions, normalize)
    return np.vstack((finished.min(axis=0), finished.max(axis=0))).astype(np.float32)


def encode(vectors: np.ndarray, encoding: Encoding, ranges: np.ndarray | None = None) -> np.ndarray:
    """[n, dim] float32 -> the encoding's array: [n, dim] float16 / int8 / uint8, or [n, ceil(dim / 8)] int8 /
    uint8 packed bits."""
    if encoding is Encoding.FLOAT32:
        return vectors
    if encoding is Encoding.FLOAT16:
        return vectors.astype(np.float16)
    if encoding in (Encoding.BINARY, Encoding.UBINARY):
        packed = np.packbits(vectors > 0, axis=-1)
        return (packed - 128).astype(np.int8) if encoding is Encoding.BINARY else packed
    if encoding in RANGED:
        if ranges is None:
            raise ValueError(f"{encoding} needs the model's calibration ranges")
        starts = ranges[0]
        steps = (ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return (buckets - 128).astype(np.int8) if encoding is Encoding.INT8 else buckets.astype(np.uint8)
    raise ValueError(f"unknown encoding {encoding!r}")


class Embedder(Protocol):
    """The port calibration embeds through: float32 results, never encoded (embedding.Embedding)."""

    async def embed(self, texts: list[str], params: EmbedParams) -> EmbedResult: ...


class Encodings:
    """A call's dense vectors in the encoding it asked for; int8 / uint8 ranges calibrated through `embedder`."""

    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder
        self.calibration = Calibration()

    async def ranges(self, params: EmbedParams) -> np.ndarray:
        """[2, dim] float32: the model's int8 / uint8 ranges for this call's dimensions and normalization."""
        return await self.calibration.ranges(self._embedder, params)

    async def apply(self, result: EmbedResult, params: EmbedParams) -> EmbedResult:
        """`result` with its dense vectors encoded (float32 ones are returned as they are)."""
        if result.embeddings is not None and params.encoding is not Encoding.FLOAT32:
            ranges = await self.ranges(params) if params.encoding in RANGED else None
            result.embeddings = encode(result.embeddings, params.encoding, ranges)
        return result


class Calibration:
    """One model's calibration vectors (pooled, before dimensions and normalization), computed once."""

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None
        self._lock = asyncio.Lock()
        self._ranges: dict[tuple[int | None, bool], np.ndarray] = {}

    async def ranges(self, embedder: Embedder, params: EmbedParams) -> np.ndarray:
        key = (params.dimensions, params.normalize)
        if key not in self._ranges:
            rows = await self._calibration_rows(embedder)
            self._ranges[key] = ranges_of(rows, params.dimensions, params.normalize)
        return self._ranges[key]

    async def _calibration_rows(self, embedder: Embedder) -> np.ndarray:
        async with self._lock:
            if self._rows is None:
                # Not through the embedding cache: calibration texts would evict the users' entries.
                raw = EmbedParams(normalize=False, truncate=True, outputs=(EmbedOutput.DENSE,), bypass_cache=True)
                texts = calibration_texts()
                parts = []
                for start in range(0, len(texts), _CALIBRATION_BATCH):
                    result = await embedder.embed(texts[start : start + _CALIBRATION_BATCH], raw)
                    parts.append(result.embeddings)
                self._rows = np.concatenate(parts)
            return self._rows
