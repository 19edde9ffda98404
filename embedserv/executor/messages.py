"""Messages between the engine and a model worker process, as zmq multipart frames. No pickle.

Frame 0 is a UTF-8 JSON header: {"kind", "batch_id", "arrays": [[name, dtype, shape], ...], ...}
plus the kind's scalars (busy_seconds, message, pid, num_kv_blocks). Frames 1.. are the raw buffers of
the listed arrays, in order: C-contiguous, little-endian, so the receiver rebuilds them with
np.frombuffer without copying (the arrays are then read-only). Send with
send_multipart(frames, copy=False) and decode what recv_multipart(copy=False) returns.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from embedserv.engine.types import SamplingParams
from embedserv.scheduler.generation import GenerationBatch, ScheduledChunk
from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput
from embedserv.worker.model_runner import ModelRunnerOutput

PREFILL = "prefill"
GENERATION = "generation"
STOP = "stop"
PREFILL_RESULT = "prefill_result"
GENERATION_RESULT = "generation_result"
ERROR = "error"
READY = "ready"
FAILED = "failed"

# Only plain numeric dtypes may come off the wire: an object dtype would mean unpickling.
_DTYPES = frozenset({"<i8", "<i4", "|i1", "<u8", "<f8", "<f4", "|b1"})

Frames = list[bytes | memoryview]
_chain = itertools.chain.from_iterable


@dataclass(frozen=True)
class Message:
    """One decoded message; which fields mean something depends on kind."""

    kind: str
    batch_id: int = -1
    # SchedulerOutput | (GenerationBatch, dict[int, SamplingParams]) | ModelRunnerOutput
    # | dict[int, int] | str (error/failed message) | None
    payload: object = None
    # Results and errors: the worker's cumulative seconds spent running batches.
    busy_seconds: float = 0.0
    pid: int = 0
    num_kv_blocks: int = 0


def _pack(kind: str, batch_id: int = -1, arrays: Mapping[str, np.ndarray] | None = None, **scalars) -> Frames:
    arrays = {k: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for k, a in (arrays or {}).items()}
    specs = [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]
    header = {"kind": kind, "batch_id": batch_id, "arrays": specs, **scalars}
    # A flat byte view: zmq takes it without copying, and it also works for zero-size arrays.
    buffers = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays.values()]
    return [json.dumps(header).encode("utf-8"), *buffers]


def _array(name: str, dtype: str, shape: list[int], frame: object) -> np.ndarray:
    if dtype not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"array {name!r} has unsupported dtype {dtype!r} or shape {shape!r}")
    # memoryview() covers bytes, memoryview and zmq.Frame alike.
    buffer = memoryview(frame)
    if buffer.nbytes != np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"array {name!r}: {buffer.nbytes} bytes do not match {dtype} {shape}")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _unpack(frames: Sequence) -> tuple[dict, dict[str, np.ndarray]]:
    if not frames:
        raise ValueError("no frames")
    header = json.loads(bytes(memoryview(frames[0])).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    specs = header["arrays"]
    if len(frames) != 1 + len(specs):
        raise ValueError(f"{len(frames) - 1} array frames, but the header lists {len(specs)}")
    return header, {spec[0]: _array(*spec, frame) for spec, frame in zip(specs, frames[1:])}



def _offsets(lengths: np.ndarray, total: int, what: str) -> list[int]:
    offsets = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
    if offsets[-1] != total:
        raise ValueError(f"{what} lengths add up to {offsets[-1]}, but {total} were sent")
    return offsets


def encode_prefill(batch_id: int, batch: SchedulerOutput) -> Frames:
    seqs = batch.sequences
    total = sum(len(s.token_ids) for s in seqs)
    arrays = {
        "request_ids": np.array([s.request_id for s in seqs], dtype=np.int64),
        "lengths": np.array([len(s.token_ids) for s in seqs], dtype=np.int32),
        "pool_starts": np.array([s.pool_start for s in seqs], dtype=np.int32),
        "token_ids": np.fromiter(_chain(s.token_ids for s in seqs), np.int32, total),
    }
    if any(s.token_type_ids is not None for s in seqs):
        # None means all zeros; the span keeps every sequence's types aligned with its tokens.
        types = (s.token_type_ids or itertools.repeat(0, len(s.token_ids)) for s in seqs)
        arrays["token_type_ids"] = np.fromiter(_chain(types), np.int8, total)
    return _pack(PREFILL, batch_id, arrays)


def _decode_prefill(arrays: dict[str, np.ndarray]) -> SchedulerOutput:
    tokens, types = arrays["token_ids"], arrays.get("token_type_ids")
    offsets = _offsets(arrays["lengths"], len(tokens), "sequence")
    sequences = tuple(
        ScheduledSequence(
            request_id=request_id,
            token_ids=tokens[a:b].tolist(),
            pool_start=pool_start,
            token_type_ids=None if types is None else types[a:b].tolist(),
        )
        for request_id, pool_start, a, b in zip(
            arrays["request_ids"].tolist(), arrays["pool_starts"].tolist(), offsets, offsets[1:]
        )
    )
    return SchedulerOutput(sequences=sequences)


def encode_generation(batch_id: int, batch: GenerationBatch, sampling: Mapping[int, SamplingParams]) -> Frames:
    chunks = batch.chunks
    params = [sampling[c.request_id] for c in chunks if c.samples]
    arrays = {
        "request_ids": np.array([c.request_id for c in chunks], dtype=np.int64),
        "num_tokens": np.array([len(c.token_ids) for c in chunks], dtype=np.int32),
        "start_positions": np.array([c.start_position for c in chunks], dtype=np.int64),
        "num_blocks": np.array([len(c.block_ids) for c in chunks], dtype=np.int32),
        "samples": np.array([c.samples for c in chunks], dtype=np.bool_),
        "token_ids": np.fromiter(_chain(c.token_ids for c in chunks), np.int32),
        "block_ids": np.fromiter(_chain(c.block_ids for c in chunks), np.int32),
        "temperature": np.array([p.temperature for p in params], dtype=np.float64),
        "top_p": np.array([p.top_p for p in params], dtype=np.float64),
        "top_k": np.array([p.top_k for p in params], dtype=np.int64),
        # uint64 holds every seed; has_seed tells seed 0 from no seed.
        "seed": np.array([p.seed or 0 for p in params], dtype=np.uint64),
        "has_seed": np.array([p.seed is not None for p in params], dtype=np.bool_),
    }
    return _pack(GENERATION, batch_id, arrays)


def _decode_generation(a: dict[str, np.ndarray]) -> tuple[GenerationBatch, dict[int, SamplingParams]]:
    request_ids, samples = a["request_ids"].tolist(), a["samples"].tolist()
    tokens, blocks = a["token_ids"], a["block_ids"]
    token_offsets = _offsets(a["num_tokens"], len(tokens), "chunk token")
    block_offsets = _offsets(a["num_blocks"], len(blocks), "block table")
    chunks = tuple(
        ScheduledChunk(
            request_id=request_ids[i],
            token_ids=tuple(tokens[token_offsets[i] : token_offsets[i + 1]].tolist()),
            start_position=start,
            block_ids=tuple(blocks[block_offsets[i] : block_offsets[i + 1]].tolist()),
            samples=samples[i],
        )
        for i, start in enumerate(a["start_positions"].tolist())
    )
    sampled_ids = [rid for rid, s in zip(request_ids, samples) if s]
    names = ("temperature", "top_p", "top_k", "seed", "has_seed")
    columns = zip(sampled_ids, *(a[name].tolist() for name in names), strict=True)
    sampling = {
        rid: SamplingParams(max_tokens=1, temperature=t, top_p=p, top_k=k, seed=seed if has_seed else None)
        for rid, t, p, k, seed, has_seed in columns
    }
    return GenerationBatch(chunks=chunks), sampling


def encode_stop() -> Frames:
    return _pack(STOP)


def encode_prefill_result(batch_id: int, output: ModelRunnerOutput, busy_seconds: float) -> Frames:
    if output.rows.ndim != 2:
        raise ValueError(f"rows must be [num_seqs, dim], got shape {output.rows.shape}")
    arrays = {
        "request_ids": np.array(output.request_ids, dtype=np.int64),
        "rows": output.rows.astype(np.float32, copy=False),
    }
    return _pack(PREFILL_RESULT, batch_id, arrays, busy_seconds=busy_seconds)


def encode_generation_result(batch_id: int, sampled: dict[int, int], busy_seconds: float) -> Frames:
    arrays = {
        "request_ids": np.fromiter(sampled.keys(), np.int64, len(sampled)),
        "tokens": np.fromiter(sampled.values(), np.int64, len(sampled)),
    }
    return _pack(GENERATION_RESULT, batch_id, arrays, busy_seconds=busy_seconds)


def encode_error(batch_id: int, message: str, busy_seconds: float) -> Frames:
    return _pack(ERROR, batch_id, message=message, busy_seconds=busy_seconds)


def encode_ready(pid: int, num_kv_blocks: int) -> Frames:
    return _pack(READY, pid=pid, num_kv_blocks=num_kv_blocks)


def encode_failed(message: str) -> Frames:
    return _pack(FAILED, message=message)


# Each kind's payload from its header and arrays.
_DECODERS: dict[str, Callable[[dict, dict[str, np.ndarray]], object]] = {
    PREFILL: lambda h, a: _decode_prefill(a),
    GENERATION: lambda h, a: _decode_generation(a),
    STOP: lambda h, a: None,
    PREFILL_RESULT: lambda h, a: ModelRunnerOutput(tuple(a["request_ids"].tolist()), a["rows"]),
    GENERATION_RESULT: lambda h, a: dict(zip(a["request_ids"].tolist(), a["tokens"].tolist(), strict=True)),
    ERROR: lambda h, a: str(h["message"]),
    READY: lambda h, a: None,
    FAILED: lambda h, a: str(h["message"]),
}


def decode(frames: Sequence) -> Message:
    """Rebuild a message from frames (bytes, memoryview or zmq.Frame); ValueError if malformed."""
    # Bad JSON, a missing field or array, a wrong type: the caller handles a single exception.
    try:
        header, arrays = _unpack(frames)
        kind = header["kind"]
        if kind not in _DECODERS:
            raise ValueError(f"unknown message kind {kind!r}")
        return Message(
            kind=kind,
            batch_id=int(header["batch_id"]),
            payload=_DECODERS[kind](header, arrays),
            busy_seconds=float(header.get("busy_seconds", 0.0)),
            pid=int(header.get("pid", 0)),
            num_kv_blocks=int(header.get("num_kv_blocks", 0)),
        )
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"malformed worker message: {type(e).__name__}: {e}") from e
