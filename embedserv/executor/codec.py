"""One codec for every engine <-> worker message: frozen dataclasses as zmq multipart frames. No pickle.

Wire format:
    frame 0    msgpack array [type_name, fields]: type_name is the message's class name, looked up in the
               codec's registry of allowed classes; fields is the dataclass as msgspec encodes it (a map of
               field name -> value; enums by value, tuples as arrays, nested dataclasses as maps). Each
               numpy array inside is replaced by [dtype, shape, frame_index].
    frames 1.. the raw buffers of those arrays, in the order they appear in frame 0: C-contiguous,
               little-endian, one plain numeric dtype from _DTYPES.

msgspec decodes frame 0 with type=the registered class, so every field is checked against its annotation
(an int field refuses a string, a tuple stays a tuple, Optional and nested dataclasses work). Arrays are
rebuilt with np.frombuffer on the received frame, without copying (read-only when the frame is). Send with
send_multipart(frames, copy=False); decode what recv_multipart(copy=False) returns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec
import numpy as np

# Only plain numeric and bool dtypes may come off the wire: an object dtype would mean unpickling.
_DTYPES = frozenset({"<i8", "<i4", "<i2", "|i1", "<u8", "<u4", "|u1", "<f8", "<f4", "<f2", "|b1"})

Frames = list[bytes | memoryview]


class _ArraySpec(msgspec.Struct, array_like=True, frozen=True):
    """Where an array's bytes are: travels in the header in place of the array."""

    dtype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    frame: int


_Header = tuple[str, msgspec.Raw]


class Codec:
    """Encodes and decodes the registered message classes (dataclasses, named by their class name)."""

    def __init__(self, types: Iterable[type]) -> None:
        self.types: dict[str, type] = {}
        for cls in types:
            if cls.__name__ in self.types:
                raise ValueError(f"two message types are named {cls.__name__!r}")
            msgspec.msgpack.Decoder(cls)  # a TypeError now for a field type msgspec cannot decode
            self.types[cls.__name__] = cls

    def encode(self, message: object) -> Frames:
        name = type(message).__name__
        if self.types.get(name) is not type(message):
            raise TypeError(f"{type(message).__qualname__} is not a registered message type")
        buffers: Frames = []

        def array_to_spec(obj: object) -> _ArraySpec:
            if not isinstance(obj, np.ndarray):
                raise NotImplementedError(f"cannot encode {type(obj).__qualname__}")
            array = obj.astype(obj.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d shapes
            if array.dtype.str not in _DTYPES:
                raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
            # A flat byte view: zmq sends it without copying, and it also works for zero-size arrays.
            buffers.append(array.reshape(-1).view(np.uint8).data)
            return _ArraySpec(array.dtype.str, array.shape, len(buffers))

        header = msgspec.msgpack.encode((name, message), enc_hook=array_to_spec)
        return [header, *buffers]

    def decode(self, frames: Sequence) -> object:
        """Rebuild a message from frames (bytes, memoryview or zmq.Frame); ValueError if malformed."""
        try:
            return self._decode(frames)
        except (ValueError, TypeError) as e:  # msgspec's errors are ValueErrors too
            raise ValueError(f"malformed worker message: {e}") from e

    def _decode(self, frames: Sequence) -> object:
        if not frames:
            raise ValueError("no frames")
        # memoryview() covers bytes, memoryview and zmq.Frame alike.
        buffers = [memoryview(frame) for frame in frames]
        name, fields = msgspec.msgpack.decode(buffers[0], type=_Header)
        cls = self.types.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        used = 0

        def spec_to_array(expected: type, obj: object) -> np.ndarray:
            nonlocal used
            if expected is not np.ndarray:
                raise NotImplementedError(f"cannot decode {expected}")
            try:
                spec = msgspec.convert(obj, _ArraySpec)
            except msgspec.ValidationError as e:  # re-raised so that msgspec adds the field's path
                raise ValueError(f"bad array spec: {e}") from None
            used += 1
            if spec.frame >= len(buffers):
                raise ValueError(f"the header refers to frame {spec.frame}, but {len(buffers)} frames came")
            if spec.frame != used:
                raise ValueError(f"array frame {spec.frame} is out of order (expected {used})")
            return _array(spec, buffers[spec.frame])

        message: object = msgspec.msgpack.decode(fields, type=cls, dec_hook=spec_to_array)
        if used != len(buffers) - 1:
            raise ValueError(f"{len(buffers) - 1} array frames, but the header lists {used}")
        return message


def _array(spec: _ArraySpec, buffer: memoryview) -> np.ndarray:
    if spec.dtype not in _DTYPES:
        raise ValueError(f"dtype {spec.dtype!r} is not allowed")
    dtype = np.dtype(spec.dtype)
    # Python ints: a huge shape cannot wrap around to match a small frame.
    expected = dtype.itemsize * math.prod(spec.shape)
    if buffer.nbytes != expected:
        what = f"{spec.dtype} {list(spec.shape)}"
        raise ValueError(f"frame {spec.frame} has {buffer.nbytes} bytes, but {what} needs {expected}")
    return np.frombuffer(buffer.cast("B"), dtype=dtype).reshape(spec.shape)
