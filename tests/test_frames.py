"""Data-plane frames: exact round trips, and every malformed input rejected with FrameError."""

from __future__ import annotations

import msgpack
import pytest

from netstorm.errors import FrameError
from netstorm.frames import (
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    ChunkHeader,
    ErrorFrame,
    Hello,
    Kind,
    Phase,
    decode_header,
    decode_prefix,
)

LIMIT = 1 << 20


def chunk(**changes: object) -> ChunkHeader:
    fields: dict[str, object] = dict(iteration=7, chunk=3, root=2, phase=Phase.UP, src=4, dst=5, origin=4, final=2,
                                     version=11, t_send=1234.5, is_aux=True, path=(4, 5, 2), count=10)
    fields.update(changes)
    return ChunkHeader(**fields)  # type: ignore[arg-type]


def roundtrip(frame: bytes) -> object:
    prefix = decode_prefix(frame[:PREFIX_SIZE], max_frame_bytes=LIMIT)
    assert prefix.header_len == len(frame) - PREFIX_SIZE
    return decode_header(prefix, frame[PREFIX_SIZE:])


def test_round_trips():
    for header in (chunk(), chunk(phase=Phase.DOWN, is_aux=False, path=(4, 2), t_send=0.0),
                   Hello(3, "abc"), Hello(0, ""), ErrorFrame("layout mismatch")):
        assert roundtrip(header.encode()) == header
    frame = chunk().encode()
    assert decode_prefix(frame, max_frame_bytes=LIMIT).payload_len == 40


def test_prefix_rejections():
    good = chunk().encode()
    with pytest.raises(FrameError, match="magic"):
        decode_prefix(b"GET / HTTP/1.1\r\n", max_frame_bytes=LIMIT)
    with pytest.raises(FrameError, match="version 9"):
        decode_prefix(PREFIX.pack(MAGIC, 9, Kind.CHUNK, 10, 0), max_frame_bytes=LIMIT)
    with pytest.raises(FrameError, match="unknown frame kind 77"):
        decode_prefix(PREFIX.pack(MAGIC, VERSION, 77, 10, 0), max_frame_bytes=LIMIT)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        decode_prefix(PREFIX.pack(MAGIC, VERSION, Kind.CHUNK, 10, LIMIT), max_frame_bytes=LIMIT)
    with pytest.raises(FrameError, match="header of"):
        decode_prefix(PREFIX.pack(MAGIC, VERSION, Kind.CHUNK, 1 << 20, 0), max_frame_bytes=1 << 30)
    with pytest.raises(FrameError, match="must not carry a payload"):
        decode_prefix(PREFIX.pack(MAGIC, VERSION, Kind.HELLO, 10, 4), max_frame_bytes=LIMIT)
    with pytest.raises(FrameError, match="truncated"):
        decode_prefix(good[:5], max_frame_bytes=LIMIT)


def body(header: object) -> bytes:
    return msgpack.packb(header)


def test_header_rejections():
    prefix = decode_prefix(chunk().encode(), max_frame_bytes=LIMIT)
    good = msgpack.unpackb(chunk().encode()[PREFIX_SIZE:])
    cases = {
        "not valid msgpack": b"\xc1\xc1",
        "Expected `object`, got `array`": body([1, 2]),
        "missing required field `it`": body({k: v for k, v in good.items() if k != "it"}),
        "unknown field `extra`": body({**good, "extra": 1}),
        r"Invalid enum value 5 - at `\$\.phase`": body({**good, "phase": 5}),
        r"Expected `int` >= 0 - at `\$\.count`": body({**good, "count": -1}),
        r"Expected `int`, got `str` - at `\$\.chunk`": body({**good, "chunk": "3"}),
        r"Invalid enum value 'int64' - at `\$\.dtype`": body({**good, "dtype": "int64"}),
        "does not join": body({**good, "path": [5, 2]}),
        "visits a node twice": body({**good, "path": [4, 5, 4, 2]}),
        "needs 44 payload bytes, prefix says 40": body({**good, "count": 11}),
        r"Expected `float` >= -1\.79\d*e\+308 - at `\$\.t_send`": body({**good, "t_send": float("nan")}),
        r"Expected `float` <= 1\.79\d*e\+308 - at `\$\.t_send`": body({**good, "t_send": float("inf")}),
        r"Expected `float`, got `bool` - at `\$\.t_send`": body({**good, "t_send": True}),
    }
    for message, data in cases.items():
        with pytest.raises(FrameError, match=message):
            decode_header(prefix, data)
    with pytest.raises(FrameError, match="unknown field `x`"):
        Hello.decode(body({"node_id": 1, "layout_hash": "", "x": 1}))
    with pytest.raises(FrameError, match=r"Expected `int`, got `bool` - at `\$\.node_id`"):
        Hello.decode(body({"node_id": True, "layout_hash": ""}))
