"""A generation stream whose caller fell behind (engine/core/generation.py: _catch_up) gets the deltas queued for
it as one: texts and tokens joined in order, the last one's finish; an error queued behind them comes next."""

from __future__ import annotations

from embedserv.engine.core.generation import _catch_up, _Stream
from embedserv.types import FinishReason, GenerationDelta


def _stream(*items) -> _Stream:
    stream = _Stream(request=None, params=None, detokenizer=None)
    for item in items:
        stream.queue.put_nowait(item)
    return stream


def test_queued_deltas_are_joined_up_to_the_last():
    last = GenerationDelta("c", (3,), FinishReason.LENGTH, 5, 3)
    stream = _stream(GenerationDelta("b", (2,)), last)
    joined = _catch_up(stream, GenerationDelta("a", (1,)))
    assert joined == GenerationDelta("abc", (1, 2, 3), FinishReason.LENGTH, 5, 3)
    assert stream.queue.empty() and stream.error is None


def test_a_delta_alone_is_returned_as_it_is_and_an_error_waits_its_turn():
    alone = GenerationDelta("a", (1,))
    assert _catch_up(_stream(), alone) is alone
    error = RuntimeError("worker gone")
    stream = _stream(GenerationDelta("b", (2,)), error, GenerationDelta("never", (9,)))
    assert _catch_up(stream, alone) == GenerationDelta("ab", (1, 2))
    assert stream.error is error
