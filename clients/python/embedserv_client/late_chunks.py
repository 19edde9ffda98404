"""Late chunking from the client: `embed_chunks` builds EmbedRequest.late_chunking and reads each input's chunks
(their character spans and vectors) back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from embedserv_client import plans
from embedserv_client.plans import Plan, chunks
from embedserv_client.v1 import embedserv_pb2 as pb

_SPLITTERS = {
    "spans": pb.CHUNK_SPLITTER_SPANS,
    "sentences": pb.CHUNK_SPLITTER_SENTENCES,
    "tokens": pb.CHUNK_SPLITTER_TOKENS,
}


@dataclass(frozen=True)
class TextChunks:
    """One input's chunks: their [start, end) character spans and their vectors, [len(spans), dimension] in the
    call's encoding; with int8 / uint8, the scale that decodes them (0 for other encodings)."""

    spans: list[tuple[int, int]]
    vectors: np.ndarray
    encoding_scale: float = 0.0


def late_chunking(
    splitter: str, spans: Sequence[Sequence[tuple[int, int]]] | None, chunk_tokens: int, overlap_tokens: int
) -> pb.LateChunking:
    if splitter not in _SPLITTERS:
        raise ValueError(f"splitter must be one of {', '.join(_SPLITTERS)}, not {splitter!r}")
    entries = [pb.CharSpans(spans=[pb.CharSpan(start=s, end=e) for s, e in entry]) for entry in spans or ()]
    return pb.LateChunking(
        splitter=_SPLITTERS[splitter], spans=entries, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens
    )


def prepared(
    texts: str | Sequence[str],
    splitter: str,
    spans: Sequence[Sequence[tuple[int, int]]] | None,
    chunk_tokens: int,
    overlap_tokens: int,
    encoding: str,
) -> tuple[list[str], bool, pb.LateChunking, str]:
    """What both clients' embed_chunks send: the texts as a list, whether one string came, the LateChunking
    message and the raw vectors' dtype."""
    items, single = plans.as_list(texts, "texts")
    # One text came with its own spans: the per-text list holds them alone.
    per_text = cast("Sequence[Sequence[tuple[int, int]]]", [spans]) if spans is not None and single else spans
    return items, single, late_chunking(splitter, per_text, chunk_tokens, overlap_tokens), plans.ENCODINGS[encoding][1]


def embed_chunks_plan(texts: list[str], size: int, single: bool, late: pb.LateChunking, dtype: str, **fields) -> Plan:
    """Requests of at most `size` texts, each with its texts' spans; the replies' chunks in input order."""
    requests, start = [], 0
    for part in chunks(texts, size):
        own = pb.LateChunking()
        own.CopyFrom(late)
        if late.spans:
            # Each request carries the spans of its own inputs (one entry per input, in order).
            del own.spans[:]
            own.spans.extend(late.spans[start : start + len(part)])
        requests.append(pb.EmbedRequest(inputs=part, late_chunking=own, **fields))
        start += len(part)
    raw = np.dtype(dtype)

    def merge(replies: list[pb.EmbedResponse]) -> TextChunks | list[TextChunks]:
        found = [
            TextChunks(
                spans=[(c.start, c.end) for c in entry.chunks],
                vectors=_rows([np.frombuffer(c.embedding.raw, dtype=raw) for c in entry.chunks], raw),
                encoding_scale=reply.encoding_scale,
            )
            for reply in replies
            for entry in reply.chunks
        ]
        return found[0] if single else found

    return Plan("Embed", requests, merge, min(size, len(texts)))


def _rows(rows: list[np.ndarray], raw: np.dtype) -> np.ndarray:
    native = raw.newbyteorder("=")
    return np.stack(rows).astype(native, copy=False) if rows else np.zeros((0, 0), dtype=native)
