"""Compact encodings: bytes per vector, and how well each one retrieves what float32 retrieves.

    python benchmarks/encoding_retrieval.py [--documents 300] [--queries 60] [--model DIR]

Real texts (benchmarks/corpus.py): each multi-line stdlib docstring gives a query (its first line) and a
document (the rest). The engine embeds documents and queries in every encoding (int8 / uint8 with the model's
scale, the per-dimension ones against its calibration ranges; engine/tasks/quantize.py), and each query ranks
every document:

- float32 / float16: dot product (the vectors are normalized);
- int8 / uint8 and their per-dimension forms: "int dot", the dot product of the integers as they come, as a
  vector store compares them (int64 sums); "int cosine", the cosine of those integers; "dequantized", the
  values decoded (int8 / uint8: code * scale, (code - 128) * scale; per dimension: each bucket's centre of the
  ranges), then the dot product;
- binary / ubinary "hamming": fewest differing bits; "float query": the float32 query against the
  documents' bits as +1 / -1 (documents stored in bits, queries not).

overlap@10 is the mean share of float32's top 10 that the encoding's top 10 holds; recall@10 the share of
queries whose own document is in the top 10. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv.engine.tasks import quantize  # noqa: E402
from embedserv.types import EmbedParams, Encoding  # noqa: E402

K = 10
INTEGER_ENCODINGS = (Encoding.INT8, Encoding.UINT8, Encoding.INT8_PER_DIMENSION, Encoding.UINT8_PER_DIMENSION)
# (encoding, scoring) rows of the table, in order.
SCORINGS = (
    (Encoding.FLOAT32, "dot"),
    (Encoding.FLOAT16, "dot"),
    *((encoding, scoring) for encoding in INTEGER_ENCODINGS for scoring in ("int dot", "int cosine", "dequantized")),
    (Encoding.BINARY, "hamming"),
    (Encoding.BINARY, "float query"),
    (Encoding.UBINARY, "hamming"),
)


@dataclass(frozen=True)
class Calibrated:
    """What decoding needs: the per-dimension ranges [2, dim] and the int8 / uint8 scales."""

    ranges: np.ndarray
    scales: dict[Encoding, float]


def retrieval_set(num_documents: int, num_queries: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(documents, queries): query i is the first line of the docstring whose remaining lines are document i;
    documents past num_queries are distractors."""
    documents, queries, seen = [], [], set()
    for text in stdlib_texts(4 * num_documents, seed=seed):
        first, _, body = text.partition("\n")
        body = " ".join(body.split())
        if len(first.split()) < 3 or len(body.split()) < 8 or body in seen:
            continue
        seen.add(body)
        documents.append(body)
        queries.append(first.strip())
        if len(documents) == num_documents:
            break
    if len(documents) < num_documents:
        raise ValueError(f"only {len(documents)} documents of {num_documents} in the corpus sample")
    return documents, queries[:num_queries]


def dequantize(values: np.ndarray, encoding: Encoding, calibrated: Calibrated) -> np.ndarray:
    """Codes back to float64: int8 code * scale; uint8 (code - 128) * scale (the centred vector); per-dimension
    buckets to the centre of their slice of the ranges."""
    codes = values.astype(np.float64)
    if encoding in (Encoding.INT8, Encoding.UINT8):
        return (codes - (128 if encoding is Encoding.UINT8 else 0)) * calibrated.scales[encoding]
    ranges = calibrated.ranges.astype(np.float64)
    buckets = codes + (128 if encoding is Encoding.INT8_PER_DIMENSION else 0)
    steps = (ranges[1] - ranges[0]) / 255
    return ranges[0] + (buckets + 0.5) * np.where(steps == 0, 1, steps)


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def _bits(values: np.ndarray) -> np.ndarray:
    """Packed binary / ubinary bytes -> [n, bits] of 0 / 1 (binary's bytes are ubinary's minus 128)."""
    unsigned = values.view(np.uint8) ^ 0x80 if values.dtype == np.int8 else values
    return np.unpackbits(unsigned, axis=-1).astype(np.int32)


def scores(
    queries: np.ndarray,
    documents: np.ndarray,
    encoding: Encoding,
    scoring: str,
    calibrated: Calibrated | None = None,
    float_queries: np.ndarray | None = None,
) -> np.ndarray:
    """[num_queries, num_documents]: higher is better."""
    if scoring == "dot":
        return queries.astype(np.float32) @ documents.astype(np.float32).T
    if scoring == "int dot":
        return queries.astype(np.int64) @ documents.astype(np.int64).T
    if scoring == "int cosine":
        return _unit(queries) @ _unit(documents).T
    if scoring == "dequantized":
        return dequantize(queries, encoding, calibrated) @ dequantize(documents, encoding, calibrated).T
    if scoring == "hamming":
        q, d = _bits(queries), _bits(documents)
        return -(q @ (1 - d).T + (1 - q) @ d.T)
    if scoring == "float query":
        signs = 2 * _bits(documents) - 1
        return float_queries @ signs[:, : float_queries.shape[1]].T.astype(np.float32)
    raise ValueError(f"unknown scoring {scoring!r}")


def top_k(scores_: np.ndarray, k: int = K) -> np.ndarray:
    """[num_queries, k] document indices, best first (ties: lower index first)."""
    return np.argsort(-scores_, axis=1, kind="stable")[:, :k]


def overlap_at_k(top: np.ndarray, reference_top: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / top.shape[1] for a, b in zip(top, reference_top, strict=True)]))


def recall_at_k(top: np.ndarray) -> float:
    """Share of queries i whose own document i is in their top k."""
    return float(np.mean([i in row for i, row in enumerate(top)]))


def bytes_per_vector(encoding: Encoding, dimension: int) -> int:
    return quantize.encode(np.ones((1, dimension), dtype=np.float32), encoding, np.zeros((2, dimension)), 1.0).nbytes


async def _measure(core, engine, documents: list[str], queries: list[str]) -> list[tuple[str, str, float, float]]:
    """Embeds once in float32, then encodes the vectors as the engine encodes a call's vectors
    (Embedding.in_encoding: the same per-vector step whatever the batch; the integer encodings calibrate the model
    on first use)."""
    await core.start()
    embedding = engine.embedding
    try:
        embedded = [(await embedding.embed(texts, EmbedParams(truncate=True))) for texts in (queries, documents)]
        encoded = {}
        for encoding in dict.fromkeys(e for e, _ in SCORINGS):
            params = EmbedParams(truncate=True, encoding=encoding)
            encoded[encoding] = [
                (await embedding.in_encoding(replace(result), params)).embeddings for result in embedded
            ]
        ranges = await embedding.encodings.ranges(EmbedParams(encoding=Encoding.INT8_PER_DIMENSION))
        scales = {e: await embedding.encodings.scale(EmbedParams(encoding=e)) for e in (Encoding.INT8, Encoding.UINT8)}
    finally:
        await core.stop()
    calibrated = Calibrated(ranges, scales)
    float_queries = encoded[Encoding.FLOAT32][0]
    reference_top = top_k(scores(*encoded[Encoding.FLOAT32], Encoding.FLOAT32, "dot"))
    rows = []
    for encoding, scoring in SCORINGS:
        top = top_k(scores(*encoded[encoding], encoding, scoring, calibrated, float_queries))
        rows.append((encoding.value, scoring, overlap_at_k(top, reference_top), recall_at_k(top)))
    return rows


def main() -> None:
    from embedserv.config import ModelConfig, bundled_model_path
    from embedserv.engine.core.local_core import LocalCore
    from embedserv.engine.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled all-MiniLM-L6-v2)")
    args = parser.parse_args()

    started = time.perf_counter()
    documents, queries = retrieval_set(args.documents, args.queries)
    model = args.model or str(bundled_model_path())
    name = Path(args.model).name if args.model else "all-MiniLM-L6-v2"
    config = ModelConfig(path=model, served_name=name, dtype="float32")
    core = LocalCore.load(config, warm_up=False)
    engine = Engine(config, core.served, core)
    dimension = engine.info.dimension
    rows = asyncio.run(_measure(core, engine, documents, queries))

    print(
        f"{name}, {dimension} dims: {len(queries)} queries over {len(documents)} documents "
        f"(stdlib docstrings), top {K}; {time.perf_counter() - started:.0f} s\n"
    )
    print(
        f"| encoding | scoring | bytes/vector ({dimension} dims) | bytes/vector (1024 dims) | overlap@{K} vs float32 "
        f"| recall@{K} |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name, scoring, overlap, recall in rows:
        encoding = Encoding(name)
        print(
            f"| {name} | {scoring} | {bytes_per_vector(encoding, dimension)} | {bytes_per_vector(encoding, 1024)} "
            f"| {overlap:.3f} | {recall:.3f} |"
        )


if __name__ == "__main__":
    main()
