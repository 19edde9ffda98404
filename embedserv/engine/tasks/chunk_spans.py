"""Late chunking's arithmetic, with no model and no tokenizer: where an input's chunks are (the call's spans,
sentences, token windows), which tokens each chunk pools, and how an input longer than the model's context is
cut into windows whose token states are stitched back together (late_chunking.py runs them).

Characters are Unicode code points (Python str indices, the Tokenize RPC's offsets); a span is [start, end).

- A token belongs to a chunk when its character range [s, e) shares at least one character with the chunk's
  span: min(e, end) - max(s, start) > 0. A token cut by a span's edge (a span ending mid-word) belongs to
  the chunk, and to its neighbour too when spans meet there; tokens with no characters (e.g. added special
  tokens) belong to none.
- Sentences: a sentence ends at whitespace that follows `.`, `!` or `?`, and at every newline; each
  sentence's span is stripped of the whitespace around it, and empty ones are dropped. Deliberately simple
  and deterministic ("e.g. x" is two sentences); send spans for anything smarter.
- Token windows: chunk k holds text tokens [k * step, k * step + chunk_tokens) with step = chunk_tokens -
  overlap_tokens (the last one shorter, reaching the end); its span runs from its first token's start to its
  last token's end.
- Context windows: an input longer than the model's context is run as windows of `room` text tokens (the
  largest that fit beside the special tokens and the prompt, each window carrying both), neighbours sharing
  a quarter of the window (room // 4), the last window moved back to end at the text's end. A token shared
  by two windows takes its state from the first window when it lies in the first half of the overlap and from
  the second otherwise, so every state comes from the window where it has more context on its short side.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from embedserv.errors import InvalidInput

# Whitespace after a sentence's closing punctuation, or any whitespace run holding a newline.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")

Span = tuple[int, int]


def sentence_spans(text: str) -> list[Span]:
    """The text's sentences as spans, in order (see the module's rule)."""
    pieces, start = [], 0
    for match in _SENTENCE_BREAK.finditer(text):
        pieces.append((start, match.start()))
        start = match.end()
    pieces.append((start, len(text)))
    spans = []
    for start, end in pieces:
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if start < end:
            spans.append((start, end))
    return spans


def token_window_spans(offsets: np.ndarray, chunk_tokens: int, overlap_tokens: int) -> list[Span]:
    """Spans of windows of `chunk_tokens` text tokens, neighbours sharing `overlap_tokens` ([t, 2] offsets)."""
    count = len(offsets)
    step = chunk_tokens - overlap_tokens
    spans = []
    for first in range(0, count, step):
        stop = min(first + chunk_tokens, count)
        spans.append((int(offsets[first, 0]), int(offsets[stop - 1, 1])))
        if stop == count:
            break
    return spans


def check_spans(index: int, text: str, spans: tuple[Span, ...]) -> None:
    """A call's own spans for input `index`: at least one, each 0 <= start < end <= len(text)."""
    if not spans:
        raise InvalidInput(f"late_chunking.spans[{index}] is empty; send at least one span for input {index}")
    for number, (start, end) in enumerate(spans):
        if not 0 <= start < end <= len(text):
            raise InvalidInput(
                f"input {index}: span {number} [{start}, {end}) is not within its {len(text)} characters; spans are "
                f"[start, end) code-point offsets with 0 <= start < end <= {len(text)}"
            )


def span_members(index: int, offsets: np.ndarray, spans: list[Span]) -> list[np.ndarray]:
    """Per span, the text tokens it holds (indices into `offsets`, [t, 2]); a span holding none is refused."""
    members = []
    for number, (start, end) in enumerate(spans):
        shared = np.minimum(offsets[:, 1], end) - np.maximum(offsets[:, 0], start)
        tokens = np.flatnonzero(shared > 0)
        if tokens.size == 0:
            raise InvalidInput(f"input {index}: span {number} [{start}, {end}) covers no token; widen it or drop it")
        members.append(tokens)
    return members


def context_windows(num_tokens: int, room: int) -> list[Span]:
    """[first, stop) text tokens of each window the model runs: one when the text fits in `room`."""
    if num_tokens <= room:
        return [(0, num_tokens)]
    stride = room - room // 4
    firsts = [*range(0, num_tokens - room, stride), num_tokens - room]
    return [(first, first + room) for first in firsts]


def owned_tokens(windows: list[Span]) -> list[Span]:
    """[first, stop) text tokens whose states each window gives: neighbours split their overlap in half."""
    cuts = [(later[0] + earlier[1]) // 2 for earlier, later in itertools.pairwise(windows)]
    bounds = [windows[0][0], *cuts, windows[-1][1]]
    return list(itertools.pairwise(bounds))


def mean_rows(states: np.ndarray, members: list[np.ndarray]) -> np.ndarray:
    """[len(members), width] float32: each chunk's mean of its tokens' states (accumulated in float64)."""
    if not members:
        return np.zeros((0, states.shape[1]), dtype=np.float32)
    return np.stack([states[tokens].mean(axis=0, dtype=np.float64) for tokens in members]).astype(np.float32)
