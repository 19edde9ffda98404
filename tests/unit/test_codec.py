"""The generic engine <-> worker codec: bit-exact round trips of the real step types (also through zmq),
zero-copy arrays, every allowed dtype, and one ValueError for every kind of malformed input."""

from __future__ import annotations

import dataclasses
import struct
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from embedserv.executor.codec import Codec
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch, StepOutput
from embedserv.types import SamplingParams


@dataclass(frozen=True)
class Ready:
    pid: int
    num_kv_blocks: int


@dataclass(frozen=True)
class Blob:
    array: np.ndarray
    maybe: np.ndarray | None = None


CODEC = Codec([StepBatch, StepOutput, Ready, Blob])
DTYPES = ["<i8", "<i4", "|i1", "<u8", "<f8", "<f4", "|b1", "|u1", "<u4", "<i2", "<f2"]

# --- strategies ---------------------------------------------------------------------------------------

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=12).map(tuple)
block_tables = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6).map(tuple), max_size=3).map(tuple)
edge_floats = [0.0, -0.0, 5e-324, -1.7976931348623157e308, float("inf"), float("-inf"), float("nan")]
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(edge_floats)
sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**31 - 1),
    temperature=floats,
    top_p=floats,
    top_k=st.integers(0, 2**31 - 1),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=8), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)
sequences = st.builds(
    ScheduledSequence,
    request_id=st.integers(0, 2**63 - 1),
    token_ids=token_ids,
    output=st.sampled_from(OutputKind),
    start_position=st.integers(0, 2**31 - 1),
    block_ids=block_tables,
    produces_output=st.booleans(),
    sampling=st.none() | sampling,
    pool_start=st.integers(0, 2**31 - 1),
    token_type_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=12).map(tuple),
)
batches = st.builds(StepBatch, sequences=st.lists(sequences, max_size=6).map(tuple))


@st.composite
def outputs(draw) -> StepOutput:
    n, d, m = draw(st.integers(0, 6)), draw(st.integers(1, 9)), draw(st.integers(0, 6))
    # Every float32 bit pattern, NaN payloads and infinities included.
    rows = draw(hnp.arrays(np.uint32, (n, d))).view(np.float32)
    ids = st.integers(0, 2**63 - 1)
    return StepOutput(
        row_request_ids=tuple(draw(st.lists(ids, min_size=n, max_size=n))),
        rows=rows,
        sampled_request_ids=tuple(draw(st.lists(ids, min_size=m, max_size=m))),
        tokens=draw(hnp.arrays(np.int64, m)),
    )


def bits(value: object) -> object:
    """A comparable form that keeps types (tuple vs list, enum vs str, int vs bool) and exact float bits."""
    if dataclasses.is_dataclass(value):
        return type(value), tuple(bits(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return type(value), tuple(bits(v) for v in value)
    if isinstance(value, float):
        return float, struct.pack("<d", value)
    if isinstance(value, np.ndarray):
        return np.ndarray, value.dtype.str, value.shape, value.tobytes()
    return type(value), value


def assert_same(decoded: object, message: object) -> None:
    assert bits(decoded) == bits(message)


# --- round trips --------------------------------------------------------------------------------------


@given(batches)
def test_step_batch_round_trip(batch: StepBatch) -> None:
    frames = CODEC.encode(batch)
    assert len(frames) == 1
    assert_same(CODEC.decode(frames), batch)


@given(outputs())
def test_step_output_round_trip_is_bit_exact(output: StepOutput) -> None:
    decoded = CODEC.decode(CODEC.encode(output))
    assert_same(decoded, output)
    assert np.array_equal(decoded.rows.view(np.uint32), output.rows.view(np.uint32))
    assert decoded.rows.dtype == np.float32 and decoded.tokens.dtype == np.int64


@pytest.fixture(scope="module")
def push_pull():
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    address = f"inproc://codec-{uuid.uuid4().hex}"
    pull.bind(address)
    push.connect(address)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    context.term()


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=batches | outputs())
def test_round_trip_through_zmq(push_pull, message: object) -> None:
    push, pull = push_pull
    push.send_multipart(CODEC.encode(message), copy=False)
    frames = pull.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    assert_same(CODEC.decode(frames), message)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3), (1, 2, 3)])
def test_every_allowed_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    array = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    decoded = CODEC.decode(CODEC.encode(Blob(array, maybe=array[..., :0] if shape else None)))
    assert_same(decoded, Blob(array, maybe=array[..., :0] if shape else None))


def test_big_endian_and_strided_arrays_arrive_little_endian_and_contiguous() -> None:
    values = np.arange(24, dtype=np.float64).reshape(4, 6)
    message = Blob(values.astype(">f8")[:, ::2], maybe=np.asfortranarray(values).astype(">i4"))
    decoded = CODEC.decode(CODEC.encode(message))
    assert decoded.array.dtype.str == "<f8" and decoded.maybe.dtype.str == "<i4"
    assert np.array_equal(decoded.array, values[:, ::2]) and np.array_equal(decoded.maybe, values)


def test_arrays_are_not_copied() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = CODEC.encode(StepOutput((1, 2, 3), rows, (), np.zeros(0, np.int64)))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), rows)
    # Decoding views the received buffer: change the buffer, the array changes.
    received = [frames[0], bytearray(frames[1]), b""]
    decoded = CODEC.decode(received)
    received[1][:4] = struct.pack("<f", 99.0)
    assert decoded.rows[0, 0] == 99.0
    assert not CODEC.decode([bytes(f) for f in frames]).rows.flags.writeable


def test_encode_refuses_unregistered_types_and_object_arrays() -> None:
    with pytest.raises(TypeError):
        CODEC.encode(SamplingParams(max_tokens=1))
    with pytest.raises(TypeError):
        CODEC.encode(Blob(np.array([object()])))
    with pytest.raises(ValueError):
        Codec([Ready, dataclass(frozen=True)(type("Ready", (), {"__annotations__": {"x": int}}))])


# --- malformed input ----------------------------------------------------------------------------------


def _header(name: str, fields: object) -> bytes:
    return msgspec.msgpack.encode([name, fields])


def _output_frames() -> list:
    output = StepOutput((7, 8), np.ones((2, 3), np.float32), (9,), np.array([5], np.int64))
    return [bytes(f) for f in CODEC.encode(output)]


def _tampered(edit) -> list:
    """A valid StepOutput whose header fields went through edit(fields) -> frames."""
    frames = _output_frames()
    name, fields = msgspec.msgpack.decode(frames[0])
    return edit(fields, frames) or [_header(name, fields), *frames[1:]]


def _set(key: str, value: object):
    return lambda fields, frames: fields.__setitem__(key, value)


def _rows(spec: object):
    return lambda: _tampered(_set("rows", spec))


def _frames(*edits):
    """The valid frames with frame i replaced by edit(frame i), for each (i, edit)."""

    def build() -> list:
        frames = _output_frames()
        for i, edit in edits:
            frames[i] = edit(frames[i])
        return frames

    return build


MALFORMED = {
    "no frames": lambda: [],
    "bad msgpack": lambda: [b"\xc1\x00"],
    "truncated msgpack": _frames((0, lambda f: f[:-3])),
    "header not a [name, fields] pair": lambda: [msgspec.msgpack.encode({"type": "Ready"})],
    "unknown type name": lambda: [_header("Popen", {"args": ["sh"]})],
    "int field gets a string": lambda: [_header("Ready", {"pid": "7", "num_kv_blocks": 1})],
    "int field gets a bool": lambda: [_header("Ready", {"pid": True, "num_kv_blocks": 1})],
    "missing field": lambda: [_header("Ready", {"pid": 7})],
    "unknown enum value": lambda: [
        _header("StepBatch", {"sequences": [{"request_id": 1, "token_ids": [1], "output": "pickle"}]})
    ],
    "tuple field gets a map": lambda: _tampered(_set("row_request_ids", {"a": 1})),
    "array spec not a list": _rows("<f4"),
    "array spec too short": _rows(["<f4", [2, 3]]),
    "missing frame": lambda: _output_frames()[:-1],
    "extra frame": lambda: [*_output_frames(), b""],
    "frame too short": _frames((1, lambda f: f[:-1])),
    "frame too long": _frames((2, lambda f: f + b"\x00")),
    "object dtype": _rows(["|O", [2, 3], 1]),
    "big-endian dtype": _rows([">f4", [2, 3], 1]),
    "complex dtype": _rows(["<c8", [2, 3], 1]),
    "unknown dtype": _rows(["no such dtype", [2, 3], 1]),
    "negative shape": _rows(["<f4", [-2, -3], 1]),
    "shape of strings": _rows(["<f4", ["2", "3"], 1]),
    "huge shape": _rows(["|u1", [2**62, 4], 1]),
    "frame index repeated": lambda: _tampered(_set("tokens", ["<i8", [1], 1])),
    "frame index out of range": lambda: _tampered(_set("tokens", ["<i8", [1], 7])),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input_raises_value_error(case: str) -> None:
    with pytest.raises(ValueError, match="^malformed worker message: "):
        CODEC.decode(MALFORMED[case]())


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_bytes_raise_value_error_or_decode(frames: list[bytes]) -> None:
    try:
        CODEC.decode(frames)
    except ValueError as e:
        assert str(e).startswith("malformed worker message: ")
