"""Generation steps as deltas: the worker keeps its running batch, the engine sends only what changed.

A generation step's StepBatch repeats, for every running sequence, its sampling params and whole block
tables, though between two steps most sequences only move on by the one token the worker itself sampled.
So a worker keeps, per request of its last generation step, what it needs to rebuild the next step: its
position, block tables, sampling params, encoder length and the last token it sampled for it; and the engine
sends a StepDelta (the message) that says what changed:

    reset            True: forget every request first (the first delta to a worker, and after a failed step)
    dropped          [d] int64: requests to forget: held, but not continued by this step (finished,
                     cancelled, preempted, or just not scheduled this time)
    new              whole ScheduledSequences of the requests the worker holds nothing for: admitted,
                     re-admitted after a preemption (recomputed from position 0), or first sent to this process
    request_ids      [n] int64: the step's sequences in batch order, new ones included
    and per sequence (ignored, 0, for new ones):
    num_tokens       [n] int64: tokens computed now, from the position the worker holds
    sent             [n] int64: how many of them are in token_ids, in order; 0 with num_tokens 1 means the
                     token the worker sampled for it in its previous step (a decode)
    token_ids        [sum(sent)] int64: prompt chunks, and recomputed tokens
    produces_output  [n] bool: the step samples the sequence's next token
    new_blocks       [n, num_groups] int64: blocks appended to each of its tables
    blocks           [sum(new_blocks)] int64: those blocks, sequence by sequence, group by group

The engine side (DeltaEncoder, one per worker process: a new process gets a new one) mirrors what it sent;
the worker side (RunningBatch) applies a delta and gives back the whole StepBatch, which the model runner
runs as any other, and records the tokens each step sampled. Block tables only grow while a request runs
(a preemption frees them and the request comes back new), so appending is enough. Prefill-only batches
(embeddings, scores) keep no KV and go whole, as RunStep; they do not touch this state. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedserv.steps import OutputKind, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import SamplingParams


@dataclass(frozen=True)
class StepDelta:
    """One generation step as the changes since the worker's previous one; see the module docstring."""

    reset: bool
    dropped: np.ndarray
    new: tuple[ScheduledSequence, ...]
    request_ids: np.ndarray
    num_tokens: np.ndarray
    sent: np.ndarray
    token_ids: np.ndarray
    produces_output: np.ndarray
    new_blocks: np.ndarray
    blocks: np.ndarray


@dataclass
class _Sent:
    """What the engine sent of one request: where its next step starts, its tables' lengths, and whether its last
    step sampled (then a one-token step continues with that token, which the worker knows)."""

    end: int
    table_lengths: tuple[int, ...]
    sampled: bool


class DeltaEncoder:
    """Engine side: StepBatch -> StepDelta against what this worker process was sent before."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        self._reset = True

    def reset(self) -> None:
        """The next delta starts over (sends every sequence whole): after a step failed, its state is unknown."""
        self._sent = {}
        self._reset = True

    def encode(self, batch: StepBatch) -> StepDelta:
        seqs = batch.sequences
        n = len(seqs)
        num_groups = len(seqs[0].block_ids) if seqs else 0
        num_tokens, sent = np.zeros(n, np.int64), np.zeros(n, np.int64)
        produces, new_blocks = np.zeros(n, bool), np.zeros((n, num_groups), np.int64)
        new: list[ScheduledSequence] = []
        tokens: list[int] = []
        blocks: list[int] = []
        before, now = self._sent, {}
        for i, seq in enumerate(seqs):
            held = before.get(seq.request_id)
            lengths = tuple(len(table) for table in seq.block_ids)
            end = seq.start_position + len(seq.token_ids)
            now[seq.request_id] = _Sent(end, lengths, seq.produces_output)
            if held is None or held.end != seq.start_position or _shrank(held.table_lengths, lengths):
                new.append(seq)
                continue
            num_tokens[i] = len(seq.token_ids)
            produces[i] = seq.produces_output
            if not (held.sampled and len(seq.token_ids) == 1):
                sent[i] = len(seq.token_ids)
                tokens.extend(seq.token_ids)
            for group, (table, length) in enumerate(zip(seq.block_ids, held.table_lengths, strict=True)):
                if len(table) > length:
                    new_blocks[i, group] = len(table) - length
                    blocks.extend(table[length:])
        if len(now) != n:
            raise ValueError("a step lists a request twice")
        dropped = np.fromiter((rid for rid in before if rid not in now), np.int64)
        reset, self._sent, self._reset = self._reset, now, False
        return StepDelta(
            reset=reset, dropped=dropped, new=tuple(new),
            request_ids=np.fromiter((s.request_id for s in seqs), np.int64, count=n), num_tokens=num_tokens,
            sent=sent, token_ids=np.array(tokens, np.int64), produces_output=produces, new_blocks=new_blocks,
            blocks=np.array(blocks, np.int64),
        )  # fmt: skip


def _shrank(before: tuple[int, ...], now: tuple[int, ...]) -> bool:
    return len(before) != len(now) or any(a > b for a, b in zip(before, now, strict=True))


@dataclass
class _Held:
    """What a worker keeps of one running request between its steps."""

    end: int
    tables: tuple[tuple[int, ...], ...]
    sampling: SamplingParams | None
    encoder_len: int
    # The token sampled at its last step (None: that step did not sample, or its result is not in yet).
    last_token: int | None = None


class RunningBatch:
    """Worker side: applies each StepDelta (in step order) and records what each step sampled."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def reset(self) -> None:
        self._held.clear()

    def apply(self, delta: StepDelta) -> StepBatch:
        """The whole step the delta stands for; ValueError if it continues a request this worker does not hold."""
        held = self._held
        if delta.reset:
            held.clear()
        for request_id in delta.dropped.tolist():
            held.pop(request_id, None)
        new = {seq.request_id: seq for seq in delta.new}
        token_ids, blocks = delta.token_ids.tolist(), delta.blocks.tolist()
        token_at = block_at = 0
        sequences = []
        columns = zip(
            delta.request_ids.tolist(), delta.num_tokens.tolist(), delta.sent.tolist(), delta.produces_output.tolist(),
            delta.new_blocks.tolist(), strict=True,
        )  # fmt: skip
        for request_id, num_tokens, sent, produces, appended in columns:
            seq = new.get(request_id)
            if seq is not None:
                end = seq.start_position + len(seq.token_ids)
                held[request_id] = _Held(end, seq.block_ids, seq.sampling, seq.encoder_len)
                sequences.append(seq)
                continue
            state = held.get(request_id)
            if state is None:
                raise ValueError(f"a step continues request {request_id}, which this worker does not hold")
            if sent:
                tokens = tuple(token_ids[token_at : token_at + sent])
                token_at += sent
            elif num_tokens == 1 and state.last_token is not None:
                tokens = (state.last_token,)
            else:
                raise ValueError(f"request {request_id}'s step needs the token it last sampled, which it has not")
            if any(appended):
                tables = []
                for table, count in zip(state.tables, appended, strict=True):
                    tables.append(table + tuple(blocks[block_at : block_at + count]))
                    block_at += count
                state.tables = tuple(tables)
            sequences.append(ScheduledSequence(
                request_id, tokens, OutputKind.SAMPLE, state.end, state.tables, produces, state.sampling,
                encoder_len=state.encoder_len,
            ))  # fmt: skip
            state.end += num_tokens
            state.last_token = None
        if len(held) != len(sequences):
            raise ValueError(f"the worker holds {len(held)} requests after a step of {len(sequences)}")
        return StepBatch(tuple(sequences))

    def record(self, output: StepOutput) -> None:
        """The tokens a step sampled: the next decode of each of those requests reads its own."""
        held = self._held
        for request_id, token in zip(output.sampled_request_ids, output.tokens.tolist(), strict=True):
            state = held.get(request_id)
            if state is not None:
                state.last_token = token
