"""The scheduler's decision for one step: which sequences run together."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence in a prefill-only batch."""

    request_id: int
    token_ids: tuple[int, ...] | list[int]
    # Pooling starts this many tokens into the sequence (prompt tokens excluded from pooling).
    pool_start: int = 0
    # Set for pair inputs (cross-encoders); None means all zeros.
    token_type_ids: tuple[int, ...] | list[int] | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)
