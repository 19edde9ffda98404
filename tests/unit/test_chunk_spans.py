"""Late chunking's arithmetic (engine/tasks/chunk_spans.py): windows, their owned tokens, splitters, membership."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from embedserv.engine.tasks import chunk_spans
from embedserv.errors import InvalidInput


@pytest.mark.parametrize("room", [1, 2, 3, 4, 7, 30, 510])
@pytest.mark.parametrize("count", [1, 5, 30, 31, 100, 4093])
def test_windows_fit_overlap_and_their_owned_tokens_tile_the_text(room, count):
    windows = chunk_spans.context_windows(count, room)
    owned = chunk_spans.owned_tokens(windows)
    assert windows[0][0] == 0 and windows[-1][1] == count
    assert all(stop - first == min(room, count) for first, stop in windows)
    assert [first for first, _ in owned] == [0, *[stop for _, stop in owned[:-1]]] and owned[-1][1] == count
    for (first, stop), (own_first, own_stop) in zip(windows, owned, strict=True):
        assert first <= own_first < own_stop <= stop
    for earlier, later in itertools.pairwise(windows):
        # Neighbours share at least a quarter of the window, and the cut is the middle of what they share.
        assert earlier[1] - later[0] >= room // 4


def test_sentence_spans_strip_whitespace_and_drop_empty_sentences():
    text = "  One.  Two!\n\n\nThree? Four... five\t\nsix"
    spans = chunk_spans.sentence_spans(text)
    assert [text[s:e] for s, e in spans] == ["One.", "Two!", "Three?", "Four...", "five", "six"]
    assert chunk_spans.sentence_spans("") == [] and chunk_spans.sentence_spans(" \n ") == []
    assert chunk_spans.sentence_spans("no end") == [(0, 6)]


def test_membership_is_a_shared_character():
    offsets = np.array([[0, 3], [4, 9], [9, 9], [9, 12]])
    # The empty token at 9 is in no span; a span cut mid-token takes the token.
    members = chunk_spans.span_members(0, offsets, [(0, 1), (8, 10), (2, 5), (0, 12)])
    assert [m.tolist() for m in members] == [[0], [1, 3], [0, 1], [0, 1, 3]]
    with pytest.raises(InvalidInput, match=r"input 0: span 1 \[3, 4\) covers no token"):
        chunk_spans.span_members(0, offsets, [(0, 1), (3, 4)])


def test_token_window_spans():
    offsets = np.array([[0, 2], [3, 5], [6, 8], [9, 11], [12, 14]])
    assert chunk_spans.token_window_spans(offsets, 2, 0) == [(0, 5), (6, 11), (12, 14)]
    assert chunk_spans.token_window_spans(offsets, 3, 1) == [(0, 8), (6, 14)]
    assert chunk_spans.token_window_spans(offsets, 9, 3) == [(0, 14)]


@pytest.mark.parametrize("spans", [(), ((0, 0),), ((-1, 2),), ((2, 1),), ((0, 6),)])
def test_spans_outside_the_text_are_refused(spans):
    with pytest.raises(InvalidInput, match="input 3"):
        chunk_spans.check_spans(3, "hello", spans)
