"""The engine <-> worker messages (executor/messages.py) through their CODEC: round trips of every message type
with the data real steps carry, through zmq too, and malformed input aimed at these types. The codec itself
(every dtype, zero copy, each kind of malformed frame) is tested generically in test_codec.py."""

from __future__ import annotations

import dataclasses
import random
import struct
import uuid

import msgspec
import numpy as np
import pytest
import zmq

from embedserv.executor.messages import CODEC, LoadFailed, Ready, RunStep, StepDone, StepFailed
from embedserv.scheduler.kv_cache_manager import KvCacheLayout, KvGroup
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import SamplingParams

NO_TOKENS = np.zeros(0, np.int64)
NO_ROWS = np.zeros((0, 0), np.float32)


def _prefill_batch(rng: random.Random, n: int, types: str) -> StepBatch:
    """Prefill-only work (embed, rerank, classify). types: "none" (no sequence has token types), "all", or
    "mixed"."""
    sequences = []
    for i in range(n):
        length = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 300)])
        token_ids = tuple(rng.randrange(2**31) for _ in range(length))
        has_types = types == "all" or (types == "mixed" and i % 2 == 0)
        token_type_ids = tuple(rng.randint(0, 1) for _ in range(length)) if has_types else None
        sequences.append(
            ScheduledSequence(
                request_id=rng.randrange(2**62),
                token_ids=token_ids,
                output=OutputKind.POOL if i % 3 else OutputKind.SCORE,
                pool_start=rng.randint(0, length - 1),
                token_type_ids=token_type_ids,
            )
        )
    return StepBatch(sequences=tuple(sequences))


def _normalised(batch: StepBatch) -> list[tuple]:
    return [(s.request_id, s.token_ids, s.output, s.pool_start, s.token_type_ids) for s in batch.sequences]


SAMPLING = [
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=50, seed=0),
    SamplingParams(max_tokens=1, temperature=0.7, top_p=0.1 + 0.2, top_k=1, seed=2**64 - 1),
    SamplingParams(max_tokens=1, temperature=1.3, top_p=1.0, top_k=0, seed=None),
    SamplingParams(max_tokens=1, temperature=0.7, seed=123456789),
]


def _generation_batch(rng: random.Random, n: int) -> StepBatch:
    """A generation step: decodes, prompt chunks, one block table per KV group (a second, fixed group as an
    encoder-decoder model's cross attention has)."""
    num_groups = rng.choice([1, 2])
    sequences = []
    for i in range(n):
        # Decode chunks carry one token; prompt chunks many, and only a prompt's last chunk samples.
        num_tokens = 1 if i % 2 else rng.randint(2, 200)
        start = rng.randint(0, 500)
        samples = num_tokens == 1 or rng.random() < 0.5
        num_blocks = (start + num_tokens + 15) // 16
        sequences.append(
            ScheduledSequence(
                request_id=1000 + i,
                token_ids=tuple(rng.randrange(2**31) for _ in range(num_tokens)),
                output=OutputKind.SAMPLE,
                start_position=start,
                block_ids=tuple(
                    tuple(rng.randrange(10_000) for _ in range(num_blocks if g == 0 else rng.randint(1, 8)))
                    for g in range(num_groups)
                ),
                produces_output=samples,
                sampling=SAMPLING[i % len(SAMPLING)] if samples else None,
            )
        )
    return StepBatch(sequences=tuple(sequences))


def _sampling(batch: StepBatch) -> dict[int, SamplingParams]:
    return {s.request_id: s.sampling for s in batch.sequences if s.sampling is not None}


def _assert_sampling_equal(got: dict[int, SamplingParams], want: dict[int, SamplingParams]) -> None:
    assert list(got) == list(want)
    for request_id, params in want.items():
        g = got[request_id]
        want = (params.temperature, params.top_p, params.top_k, params.seed)
        assert (g.temperature, g.top_p, g.top_k, g.seed) == want
        assert type(g.seed) is type(params.seed)
        assert g == params  # max_tokens, stop and ignore_eos travel too


def _bits(value: object) -> object:
    """A comparable form of a message that keeps types and exact float bits (arrays included)."""
    if dataclasses.is_dataclass(value):
        return type(value), tuple(_bits(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_bits(v) for v in value)
    if isinstance(value, float):
        return float, struct.pack("<d", value)
    if isinstance(value, np.ndarray):
        return np.ndarray, value.dtype.str, value.shape, value.tobytes()
    return type(value), value


def _round_trip(message: object) -> object:
    decoded = CODEC.decode(CODEC.encode(message))
    assert type(decoded) is type(message)
    return decoded


def _step_done(step_id: int, rows: np.ndarray, sampled: dict[int, int], busy: float, row_ids=None) -> StepDone:
    row_ids = tuple(range(10, 10 + len(rows))) if row_ids is None else row_ids
    tokens = np.fromiter(sampled.values(), np.int64, len(sampled))
    return StepDone(step_id, StepOutput(row_ids, rows, tuple(sampled), tokens), busy)


@pytest.mark.parametrize("types", ["none", "all", "mixed"])
@pytest.mark.parametrize("seed", range(5))
def test_prefill_round_trip(types: str, seed: int):
    rng = random.Random(seed)
    batch = _prefill_batch(rng, rng.randint(1, 12), types)
    message = _round_trip(RunStep(seed, batch))
    assert message.step_id == seed
    got = message.batch
    assert isinstance(got, StepBatch)
    assert all(isinstance(s.token_ids, tuple) for s in got.sequences)
    # Exactly what was sent: a sequence without token types (all zeros) still has None, the others theirs.
    assert _normalised(got) == _normalised(batch)
    assert got == batch and not got.uses_kv_cache


def test_prefill_without_token_types_sends_no_types_frame():
    """A step is one frame, token types or not: no arrays; a sequence without types sends nil for them."""
    batch = _prefill_batch(random.Random(0), 4, "none")
    frames = CODEC.encode(RunStep(1, batch))
    assert len(frames) == 1
    name, fields = msgspec.msgpack.decode(frames[0])
    assert name == "RunStep"
    assert [s["token_type_ids"] for s in fields["batch"]["sequences"]] == [None] * 4
    assert len(CODEC.encode(RunStep(1, _prefill_batch(random.Random(0), 4, "all")))) == 1


@pytest.mark.parametrize("seed", range(5))
def test_generation_round_trip(seed: int):
    rng = random.Random(seed)
    batch = _generation_batch(rng, rng.randint(1, 16))
    message = _round_trip(RunStep(7, batch))
    assert message.step_id == 7
    got_batch = message.batch
    assert got_batch == batch and got_batch.uses_kv_cache
    assert all(
        isinstance(s.token_ids, tuple)
        and isinstance(s.block_ids, tuple)
        and all(isinstance(table, tuple) for table in s.block_ids)
        for s in got_batch.sequences
    )
    _assert_sampling_equal(_sampling(got_batch), _sampling(batch))


def test_generation_seeds_and_greedy_survive():
    sequences = tuple(
        ScheduledSequence(i, (i,), OutputKind.SAMPLE, 0, ((i,),), True, params) for i, params in enumerate(SAMPLING)
    )
    got = _sampling(_round_trip(RunStep(0, StepBatch(sequences))).batch)
    assert [p.seed for p in got.values()] == [None, 0, 2**64 - 1, None, 123456789]
    assert got[0].is_greedy and not got[1].is_greedy
    _assert_sampling_equal(got, dict(enumerate(SAMPLING)))


def test_generation_ignores_sampling_for_chunks_that_do_not_sample():
    """Only a sequence that produces an output carries sampling params (the scheduler's chunks), and that is what
    arrives."""
    sequences = (
        ScheduledSequence(1, (5, 6), OutputKind.SAMPLE, 0, ((0,),), produces_output=False),
        ScheduledSequence(2, (7,), OutputKind.SAMPLE, 3, ((1,),), produces_output=True, sampling=SAMPLING[2]),
    )
    got = _round_trip(RunStep(0, StepBatch(sequences))).batch
    _assert_sampling_equal(_sampling(got), {2: SAMPLING[2]})
    assert [s.produces_output for s in got.sequences] == [False, True]


@pytest.mark.parametrize("dim", [384, 1])
@pytest.mark.parametrize("n", [0, 1, 9])
def test_prefill_result_rows_are_bit_exact(n: int, dim: int):
    rows = np.random.default_rng(n).standard_normal((n, dim)).astype(np.float32)
    if n:
        rows[0, 0] = np.nan
        rows[-1, -1] = -0.0
    busy = 0.1 + 0.2
    sent = _step_done(3, rows, {}, busy)
    message = _round_trip(sent)
    got = message.output
    assert (message.step_id, message.busy_seconds) == (3, busy)
    assert got.row_request_ids == sent.output.row_request_ids
    assert got.rows.dtype == np.float32 and got.rows.shape == (n, dim)
    np.testing.assert_array_equal(got.rows.view(np.uint32), rows.view(np.uint32))
    assert got.sampled() == {} and got.tokens.dtype == np.int64
    # Neither side copies: in one process the decoded rows are a view of the encoded ones.
    assert n == 0 or np.shares_memory(got.rows, rows)


@pytest.mark.parametrize("sampled", [{}, {1: 0, 2: 151_643, 2**40: 2**31 - 1}])
def test_generation_result_round_trip(sampled: dict[int, int]):
    sent = _step_done(5, NO_ROWS, sampled, 12345.678901234567)
    message = _round_trip(sent)
    assert _bits(message) == _bits(sent)
    assert (message.step_id, message.busy_seconds) == (5, 12345.678901234567)
    assert message.output.sampled() == sampled
    assert message.output.tokens.dtype == np.int64 and message.output.row_request_ids == ()


def test_empty_batches():
    assert _round_trip(RunStep(0, StepBatch(sequences=()))) == RunStep(0, StepBatch(sequences=()))
    empty = StepDone(1, StepOutput((), NO_ROWS, (), NO_TOKENS), 0.0)
    assert _bits(_round_trip(empty)) == _bits(empty)


def test_control_messages_round_trip():
    assert _round_trip(StepFailed(4, "CUDA out of memory ✗", 2.5)) == StepFailed(4, "CUDA out of memory ✗", 2.5)
    one_group = Ready(4321, KvCacheLayout(977, (KvGroup(16),)))
    assert _round_trip(one_group) == one_group
    # An encoder-decoder model: a growing self-attention group and a fixed cross-attention one.
    two_groups = Ready(4321, KvCacheLayout(977, (KvGroup(16), KvGroup(32, fixed=True))))
    got = _round_trip(two_groups)
    assert got == two_groups and isinstance(got.kv_cache.groups, tuple)
    assert all(type(g) is KvGroup for g in got.kv_cache.groups)
    assert _round_trip(Ready(4321, None)) == Ready(4321, None)  # a model that keeps no KV cache
    assert _round_trip(LoadFailed("no such model")) == LoadFailed("no such model")


def test_frames_are_a_header_then_raw_buffers():
    rows = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    frames = CODEC.encode(_step_done(0, rows, {7: 1, 8: 2}, 0.5))
    name, fields = msgspec.msgpack.decode(frames[0])
    assert name == "StepDone"
    specs = [fields["output"]["rows"], fields["output"]["tokens"]]
    assert specs == [["<f4", [3, 8], 1], ["<i8", [2], 2]]
    assert len(frames) == 1 + len(specs)
    for (dtype, shape, index), frame in zip(specs, frames[1:], strict=True):
        assert isinstance(frame, memoryview) and frames[index] is frame
        assert np.frombuffer(frame, dtype=dtype).reshape(shape).nbytes == memoryview(frame).nbytes
    # bytes and memoryview frames decode alike.
    assert _bits(CODEC.decode([bytes(f) for f in frames])) == _bits(CODEC.decode([memoryview(f) for f in frames]))


@pytest.fixture
def pair():
    context = zmq.Context()
    address = f"inproc://worker-messages-{uuid.uuid4().hex}"
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.rcvtimeo = 5000
    receiver.bind(address)
    sender.connect(address)
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)
    context.term()


def test_round_trip_through_zmq(pair):
    sender, receiver = pair
    rng = random.Random(42)
    prefill = _prefill_batch(rng, 6, "mixed")
    generation = _generation_batch(rng, 8)
    rows = np.random.default_rng(0).standard_normal((6, 384)).astype(np.float32)
    sent = [
        RunStep(1, prefill),
        RunStep(2, generation),
        _step_done(1, rows, {}, 0.25, row_ids=tuple(range(6))),
        _step_done(2, NO_ROWS, {1000: 17, 1001: 0}, 0.5),
        StepFailed(3, "boom", 0.75),
        Ready(99, KvCacheLayout(10, (KvGroup(16),))),
        LoadFailed("bad weights"),
    ]
    for message in sent:
        sender.send_multipart(CODEC.encode(message), copy=False)
    received = []
    for _ in sent:
        frames = receiver.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        received.append(CODEC.decode(frames))
    assert [type(m) for m in received] == [RunStep, RunStep, StepDone, StepDone, StepFailed, Ready, LoadFailed]
    assert _normalised(received[0].batch) == _normalised(prefill)
    assert received[1].batch == generation
    _assert_sampling_equal(_sampling(received[1].batch), _sampling(generation))
    np.testing.assert_array_equal(received[2].output.rows.view(np.uint32), rows.view(np.uint32))
    assert received[2].busy_seconds == 0.25
    assert received[3].output.sampled() == {1000: 17, 1001: 0}
    assert [_bits(m) for m in received] == [_bits(m) for m in sent]


def _header(name: str, fields: object) -> bytes:
    return msgspec.msgpack.encode([name, fields])


def _fields(message: object) -> tuple[str, dict, list]:
    """A valid message's type name, header fields (to edit) and array frames."""
    frames = [bytes(f) for f in CODEC.encode(message)]
    name, fields = msgspec.msgpack.decode(frames[0])
    return name, fields, frames[1:]


def _step_done_without_tokens() -> list:
    name, fields, arrays = _fields(_step_done(1, np.ones((2, 3), np.float32), {9: 5}, 0.5))
    del fields["output"]["tokens"]
    return [_header(name, fields), *arrays[:1]]


def _bare_step_output() -> list:
    """A valid StepDone's output, sent on its own with its arrays."""
    _, fields, arrays = _fields(_step_done(1, np.ones((2, 3), np.float32), {9: 5}, 0.5))
    return [_header("StepOutput", fields["output"]), *arrays]


def _run_step_with(**changes) -> list:
    seq = ScheduledSequence(1, (5, 6), OutputKind.SAMPLE, 0, ((0, 1),), True, SAMPLING[1])
    name, fields, _ = _fields(RunStep(1, StepBatch((seq,))))
    fields["batch"]["sequences"][0].update(changes)
    return [_header(name, fields)]


# What the generic cases of test_codec.py do not cover: these types' own fields, and only messages are messages.
MALFORMED = {
    "text frame": lambda: ["hello"],
    "a bare StepBatch is not a message": lambda: [_header("StepBatch", {"sequences": []})],
    "a bare StepOutput is not a message": _bare_step_output,
    "error without message": lambda: [_header("StepFailed", {"step_id": 1, "busy_seconds": 0.0})],
    "result without its tokens array": _step_done_without_tokens,
    "flat block table (one per KV group)": lambda: _run_step_with(block_ids=[0, 1]),
    "token id not an int": lambda: _run_step_with(token_ids=[5, "6"]),
    "seed not an int": lambda: _run_step_with(sampling={**dataclasses.asdict(SAMPLING[1]), "seed": "0"}),
    "sampling without max_tokens": lambda: _run_step_with(sampling={"temperature": 0.7}),
    "KV group not a group": lambda: [_header("Ready", {"pid": 1, "kv_cache": {"num_blocks": 977, "groups": [16]}})],
    "Ready without kv_cache": lambda: [_header("Ready", {"pid": 1})],
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_messages_raise_value_error(case: str):
    with pytest.raises(ValueError, match="^malformed worker message: "):
        CODEC.decode(MALFORMED[case]())
