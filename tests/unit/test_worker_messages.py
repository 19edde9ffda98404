"""The engine <-> worker wire format: round trips for every kind, through zmq too, and malformed input."""

from __future__ import annotations

import json
import random
import uuid

import numpy as np
import pytest
import zmq

from embedserv.engine.types import SamplingParams
from embedserv.executor import messages
from embedserv.executor.messages import Message, decode
from embedserv.scheduler.generation import GenerationBatch, ScheduledChunk
from embedserv.scheduler.outputs import ScheduledSequence, SchedulerOutput
from embedserv.worker.model_runner import ModelRunnerOutput


def _prefill_batch(rng: random.Random, n: int, types: str) -> SchedulerOutput:
    """types: "none" (no sequence has token types), "all", or "mixed"."""
    sequences = []
    for i in range(n):
        length = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 300)])
        token_ids = [rng.randrange(2**31) for _ in range(length)]
        has_types = types == "all" or (types == "mixed" and i % 2 == 0)
        token_type_ids = [rng.randint(0, 1) for _ in range(length)] if has_types else None
        sequences.append(
            ScheduledSequence(
                request_id=rng.randrange(2**62),
                token_ids=tuple(token_ids) if i % 3 == 0 else token_ids,
                pool_start=rng.randint(0, length - 1),
                token_type_ids=token_type_ids,
            )
        )
    return SchedulerOutput(sequences=tuple(sequences))


def _normalised(batch: SchedulerOutput) -> list[tuple]:
    return [
        (s.request_id, list(s.token_ids), s.pool_start, None if s.token_type_ids is None else list(s.token_type_ids))
        for s in batch.sequences
    ]


SAMPLING = [
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=50, seed=0),
    SamplingParams(max_tokens=1, temperature=0.7, top_p=0.1 + 0.2, top_k=1, seed=2**64 - 1),
    SamplingParams(max_tokens=1, temperature=1.3, top_p=1.0, top_k=0, seed=None),
    SamplingParams(max_tokens=1, temperature=0.7, seed=123456789),
]


def _generation_batch(rng: random.Random, n: int) -> tuple[GenerationBatch, dict[int, SamplingParams]]:
    chunks, sampling = [], {}
    for i in range(n):
        request_id = 1000 + i
        # Decode chunks carry one token; prompt chunks many, and only a prompt's last chunk samples.
        num_tokens = 1 if i % 2 else rng.randint(2, 200)
        start = rng.randint(0, 500)
        samples = num_tokens == 1 or rng.random() < 0.5
        num_blocks = (start + num_tokens + 15) // 16
        chunks.append(
            ScheduledChunk(
                request_id=request_id,
                token_ids=tuple(rng.randrange(2**31) for _ in range(num_tokens)),
                start_position=start,
                block_ids=tuple(rng.randrange(10_000) for _ in range(num_blocks)),
                samples=samples,
            )
        )
        if samples:
            sampling[request_id] = SAMPLING[i % len(SAMPLING)]
    return GenerationBatch(chunks=tuple(chunks)), sampling


def _assert_sampling_equal(got: dict[int, SamplingParams], want: dict[int, SamplingParams]) -> None:
    assert list(got) == list(want)
    for request_id, params in want.items():
        g = got[request_id]
        assert (g.temperature, g.top_p, g.top_k, g.seed) == (params.temperature, params.top_p, params.top_k, params.seed)
        assert type(g.seed) is type(params.seed)


@pytest.mark.parametrize("types", ["none", "all", "mixed"])
@pytest.mark.parametrize("seed", range(5))
def test_prefill_round_trip(types: str, seed: int):
    rng = random.Random(seed)
    batch = _prefill_batch(rng, rng.randint(1, 12), types)
    message = decode(messages.encode_prefill(seed, batch))
    assert (message.kind, message.batch_id) == (messages.PREFILL, seed)
    got = message.payload
    assert isinstance(got, SchedulerOutput)
    assert all(isinstance(s.token_ids, list) for s in got.sequences)
    want = _normalised(batch)
    if types == "mixed":
        # Once any sequence has token types, every sequence gets them: zeros where there were none.
        want = [(r, t, p, [0] * len(t) if tt is None else tt) for r, t, p, tt in want]
    assert _normalised(got) == want


def test_prefill_without_token_types_sends_no_types_frame():
    batch = _prefill_batch(random.Random(0), 4, "none")
    header = json.loads(messages.encode_prefill(1, batch)[0])
    assert [name for name, _, _ in header["arrays"]] == ["request_ids", "lengths", "pool_starts", "token_ids"]


@pytest.mark.parametrize("seed", range(5))
def test_generation_round_trip(seed: int):
    rng = random.Random(seed)
    batch, sampling = _generation_batch(rng, rng.randint(1, 16))
    message = decode(messages.encode_generation(7, batch, sampling))
    assert (message.kind, message.batch_id) == (messages.GENERATION, 7)
    got_batch, got_sampling = message.payload
    assert got_batch == batch
    assert all(isinstance(c.token_ids, tuple) and isinstance(c.block_ids, tuple) for c in got_batch.chunks)
    _assert_sampling_equal(got_sampling, sampling)


def test_generation_seeds_and_greedy_survive():
    chunks = tuple(ScheduledChunk(i, (i,), 0, (i,), True) for i in range(len(SAMPLING)))
    sampling = dict(enumerate(SAMPLING))
    _, got = decode(messages.encode_generation(0, GenerationBatch(chunks), sampling)).payload
    assert [p.seed for p in got.values()] == [None, 0, 2**64 - 1, None, 123456789]
    assert got[0].is_greedy and not got[1].is_greedy
    _assert_sampling_equal(got, sampling)


def test_generation_ignores_sampling_for_chunks_that_do_not_sample():
    chunks = (ScheduledChunk(1, (5, 6), 0, (0,), False), ScheduledChunk(2, (7,), 3, (1,), True))
    sampling = {1: SAMPLING[1], 2: SAMPLING[2]}
    _, got = decode(messages.encode_generation(0, GenerationBatch(chunks), sampling)).payload
    _assert_sampling_equal(got, {2: SAMPLING[2]})


@pytest.mark.parametrize("dim", [384, 1])
@pytest.mark.parametrize("n", [0, 1, 9])
def test_prefill_result_rows_are_bit_exact(n: int, dim: int):
    rows = np.random.default_rng(n).standard_normal((n, dim)).astype(np.float32)
    if n:
        rows[0, 0] = np.nan
        rows[-1, -1] = -0.0
    output = ModelRunnerOutput(request_ids=tuple(range(10, 10 + n)), rows=rows)
    busy = 0.1 + 0.2
    message = decode(messages.encode_prefill_result(3, output, busy))
    got = message.payload
    assert (message.kind, message.batch_id, message.busy_seconds) == (messages.PREFILL_RESULT, 3, busy)
    assert got.request_ids == output.request_ids
    assert got.rows.dtype == np.float32 and got.rows.shape == (n, dim)
    np.testing.assert_array_equal(got.rows.view(np.uint32), rows.view(np.uint32))
    # Neither side copies: in one process the decoded rows are a view of the encoded ones.
    assert n == 0 or np.shares_memory(got.rows, rows)


@pytest.mark.parametrize("sampled", [{}, {1: 0, 2: 151_643, 2**40: 2**31 - 1}])
def test_generation_result_round_trip(sampled: dict[int, int]):
    message = decode(messages.encode_generation_result(5, sampled, 12345.678901234567))
    assert message == Message(messages.GENERATION_RESULT, 5, sampled, busy_seconds=12345.678901234567)


def test_empty_batches():
    prefill = decode(messages.encode_prefill(0, SchedulerOutput(sequences=())))
    assert prefill.payload == SchedulerOutput(sequences=())
    generation = decode(messages.encode_generation(1, GenerationBatch(chunks=()), {}))
    assert generation.payload == (GenerationBatch(chunks=()), {})


def test_control_messages_round_trip():
    assert decode(messages.encode_stop()) == Message(messages.STOP)
    assert decode(messages.encode_error(4, "CUDA out of memory ✗", 2.5)) == Message(
        messages.ERROR, 4, "CUDA out of memory ✗", busy_seconds=2.5
    )
    assert decode(messages.encode_ready(4321, 977)) == Message(messages.READY, pid=4321, num_kv_blocks=977)
    assert decode(messages.encode_failed("no such model")) == Message(messages.FAILED, payload="no such model")


def test_frames_are_json_then_raw_buffers():
    batch = _prefill_batch(random.Random(1), 3, "all")
    frames = messages.encode_prefill(0, batch)
    header = json.loads(bytes(frames[0]).decode("utf-8"))
    assert len(frames) == 1 + len(header["arrays"])
    for (name, dtype, shape), frame in zip(header["arrays"], frames[1:]):
        assert isinstance(frame, memoryview)
        assert np.frombuffer(frame, dtype=dtype).reshape(shape).nbytes == memoryview(frame).nbytes, name
    # bytes and memoryview frames decode alike.
    assert decode([bytes(f) for f in frames]) == decode([memoryview(f) for f in frames])


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
    generation, sampling = _generation_batch(rng, 8)
    rows = np.random.default_rng(0).standard_normal((6, 384)).astype(np.float32)
    sent = [
        messages.encode_prefill(1, prefill),
        messages.encode_generation(2, generation, sampling),
        messages.encode_prefill_result(1, ModelRunnerOutput(tuple(range(6)), rows), 0.25),
        messages.encode_generation_result(2, {1000: 17, 1001: 0}, 0.5),
        messages.encode_error(3, "boom", 0.75),
        messages.encode_ready(99, 10),
        messages.encode_failed("bad weights"),
        messages.encode_stop(),
    ]
    for frames in sent:
        sender.send_multipart(frames, copy=False)
    received = []
    for _ in sent:
        frames = receiver.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        received.append(decode(frames))
    assert [m.kind for m in received] == [
        "prefill", "generation", "prefill_result", "generation_result", "error", "ready", "failed", "stop"
    ]
    assert _normalised(received[0].payload) == _normalised(decode(sent[0]).payload)
    assert received[1].payload[0] == generation
    _assert_sampling_equal(received[1].payload[1], sampling)
    np.testing.assert_array_equal(received[2].payload.rows.view(np.uint32), rows.view(np.uint32))
    assert received[2].busy_seconds == 0.25
    assert received[3].payload == {1000: 17, 1001: 0}
    assert received[4:] == [decode(frames) for frames in sent[4:]]


def _header(frames: list) -> dict:
    return json.loads(bytes(frames[0]))


def _with_header(frames: list, header: dict) -> list:
    return [json.dumps(header).encode(), *frames[1:]]


def _malformed() -> dict[str, list]:
    frames = messages.encode_prefill(0, _prefill_batch(random.Random(3), 3, "none"))
    header = _header(frames)
    wrong_dtype = json.loads(json.dumps(header))
    wrong_dtype["arrays"][0][1] = "|O"
    short_lengths = json.loads(json.dumps(header))
    short_lengths["arrays"][3][2] = [header["arrays"][3][2][0] - 1]
    return {
        "no frames": [],
        "unknown kind": _with_header(frames, {**header, "kind": "teleport"}),
        "missing kind": _with_header(frames, {k: v for k, v in header.items() if k != "kind"}),
        "missing frame": frames[:-1],
        "extra frame": [*frames, b"\0" * 8],
        "bad json": [b"{not json", *frames[1:]],
        "not utf-8": [b"\xff\xfe\xfd", *frames[1:]],
        "header not an object": [b"[1, 2]", *frames[1:]],
        "wrong buffer size": [*frames[:-1], bytes(frames[-1])[:-4]],
        "object dtype": _with_header(frames, wrong_dtype),
        "lengths disagree with tokens": [*_with_header(frames, short_lengths)[:-1], bytes(frames[-1])[:-4]],
        "missing array": [
            json.dumps({**header, "arrays": header["arrays"][:-1]}).encode(),
            *frames[1:-1],
        ],
        "error without message": [json.dumps({"kind": "error", "batch_id": 1, "arrays": []}).encode()],
        "text frame": ["hello"],
    }


@pytest.mark.parametrize("case", list(_malformed()))
def test_malformed_messages_raise_value_error(case: str):
    with pytest.raises(ValueError, match="malformed worker message"):
        decode(_malformed()[case])
