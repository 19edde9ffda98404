"""Which status a cancelled gRPC handler ends with: the client's deadline, or the client going away."""

from __future__ import annotations

import grpc
import pytest

from embedserv.server.calls import _cancel_code


class _Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    ("remaining", "code"),
    [
        (-0.01, grpc.StatusCode.DEADLINE_EXCEEDED),
        (0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
        # The client's clock ran out first: its reset arrived before our copy of the deadline ended.
        (0.3, grpc.StatusCode.DEADLINE_EXCEEDED),
        (5.0, grpc.StatusCode.CANCELLED),
        (None, grpc.StatusCode.CANCELLED),  # no deadline: only the client going away cancels
    ],
)
def test_a_call_cancelled_near_its_deadline_counts_as_deadline_exceeded(remaining, code):
    assert _cancel_code(_Context(remaining)) is code
