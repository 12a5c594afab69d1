"""Data-plane frames between general nodes.

A frame is a fixed 14-byte prefix, a msgpack header and a raw little-endian payload::

    magic b"NSF1" | version u8 | kind u8 | header length u32 | payload length u32 | header | payload

The prefix alone tells the receiver how many bytes follow, so the payload can be received straight
into a preallocated numpy array. Every header is a frozen dataclass with an explicit encode/decode;
decoding rejects anything unknown with ``FrameError`` before a single payload byte is accepted.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack

from netstorm.errors import FrameError

MAGIC = b"NSF1"
VERSION = 1
PREFIX = struct.Struct("<4sBBII")
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 16 * 1024
"""A header is a few hundred bytes; anything larger is a broken or hostile peer."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHUNK = 2
    ERROR = 3


class Phase(enum.IntEnum):
    UP = 0
    """Partial sums travelling from children towards the chunk's root."""
    DOWN = 1
    """The full sum travelling from the root back down the same tree."""


@dataclasses.dataclass(frozen=True)
class Prefix:
    kind: Kind
    header_len: int
    payload_len: int

    @property
    def frame_len(self) -> int:
        return PREFIX_SIZE + self.header_len + self.payload_len


def decode_prefix(data: bytes | bytearray | memoryview, *, max_frame_bytes: int) -> Prefix:
    """Parse and bound-check a prefix; FrameError names what is wrong."""
    if len(data) < PREFIX_SIZE:
        raise FrameError(f"truncated frame prefix: {len(data)} of {PREFIX_SIZE} bytes")
    magic, version, kind, header_len, payload_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a NetStorm data-plane peer")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this node speaks {VERSION})")
    try:
        kind_value = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(f"header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if PREFIX_SIZE + header_len + payload_len > max_frame_bytes:
        raise FrameError(f"frame of {PREFIX_SIZE + header_len + payload_len} bytes exceeds "
                         f"max_frame_bytes={max_frame_bytes}")
    if kind_value is not Kind.CHUNK and payload_len:
        raise FrameError(f"{kind_value.name} frame must not carry a payload ({payload_len} bytes)")
    return Prefix(kind_value, header_len, payload_len)


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in data:
        raise FrameError(f"{what} header lacks {name!r}")
    value = data[name]
    if isinstance(value, bool) and kind is int:
        raise FrameError(f"{what} header: {name} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise FrameError(f"{what} header: {name} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _unpack(data: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise FrameError(f"{what} header is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"{what} header must be a map, got {type(obj).__name__}")
    return obj


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise FrameError(f"{what} header has unknown fields {unknown}")


def _frame(kind: Kind, header: dict[str, Any], payload_len: int = 0) -> bytes:
    body = msgpack.packb(header)
    return PREFIX.pack(MAGIC, VERSION, kind, len(body), payload_len) + body


@dataclasses.dataclass(frozen=True)
class Hello:
    """First frame of every connection: who the sender is and which layout it serves."""

    KIND: ClassVar[Kind] = Kind.HELLO
    FIELDS: ClassVar[frozenset[str]] = frozenset({"node_id", "layout_hash"})

    node_id: int
    layout_hash: str
    """The sender's layout hash, or "" while its trainer has not registered yet."""

    def encode(self) -> bytes:
        return _frame(Kind.HELLO, {"node_id": self.node_id, "layout_hash": self.layout_hash})

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Hello:
        obj = _unpack(data, "Hello")
        _check_keys(obj, cls.FIELDS, "Hello")
        return cls(_field(obj, "node_id", int, "Hello"), _field(obj, "layout_hash", str, "Hello"))


@dataclasses.dataclass(frozen=True)
class ErrorFrame:
    """Why the receiver is closing the connection."""

    KIND: ClassVar[Kind] = Kind.ERROR
    FIELDS: ClassVar[frozenset[str]] = frozenset({"message"})

    message: str

    def encode(self) -> bytes:
        return _frame(Kind.ERROR, {"message": self.message})

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ErrorFrame:
        obj = _unpack(data, "Error")
        _check_keys(obj, cls.FIELDS, "Error")
        return cls(_field(obj, "message", str, "Error"))


WIRE_DTYPES: dict[str, int] = {"float32": 4}
"""Payload dtypes on the wire (little-endian) and their item sizes; sums always travel as float32."""


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """One hop of one chunk.

    ``origin`` and ``final`` are the ends of the tree edge the chunk travels; ``src`` and ``dst`` are
    this hop's ends. On the primary path they coincide; an auxiliary chunk carries ``is_aux`` and the
    source-chosen ``path`` (origin ... final) that every intermediate node follows.
    """

    KIND: ClassVar[Kind] = Kind.CHUNK
    FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"it", "chunk", "root", "phase", "src", "dst", "origin", "final", "ver", "t_send", "aux", "path",
         "count", "dtype"})

    iteration: int
    chunk: int
    root: int
    phase: Phase
    src: int
    dst: int
    origin: int
    final: int
    version: int
    t_send: float
    is_aux: bool
    path: tuple[int, ...]
    count: int
    dtype: str = "float32"

    @property
    def payload_len(self) -> int:
        return self.count * WIRE_DTYPES[self.dtype]

    def hop(self, src: int, dst: int, t_send: float) -> ChunkHeader:
        """The same chunk on its next hop."""
        return dataclasses.replace(self, src=src, dst=dst, t_send=t_send)

    def encode(self) -> bytes:
        """Prefix and header; the payload follows as raw bytes."""
        header = {"it": self.iteration, "chunk": self.chunk, "root": self.root, "phase": int(self.phase),
                  "src": self.src, "dst": self.dst, "origin": self.origin, "final": self.final,
                  "ver": self.version, "t_send": float(self.t_send), "aux": self.is_aux,
                  "path": list(self.path), "count": self.count, "dtype": self.dtype}
        return _frame(Kind.CHUNK, header, self.payload_len)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ChunkHeader:
        obj = _unpack(data, "Chunk")
        _check_keys(obj, cls.FIELDS, "Chunk")
        ints = {name: _field(obj, name, int, "Chunk")
                for name in ("it", "chunk", "root", "phase", "src", "dst", "origin", "final", "ver", "count")}
        for name in ("it", "chunk", "ver", "count"):
            if ints[name] < 0:
                raise FrameError(f"Chunk header: {name} must be >= 0, got {ints[name]}")
        try:
            phase = Phase(ints["phase"])
        except ValueError:
            raise FrameError(f"Chunk header: unknown phase {ints['phase']}") from None
        t_send = _field(obj, "t_send", (float, int), "Chunk")
        if isinstance(t_send, bool) or not math.isfinite(t_send):
            raise FrameError(f"Chunk header: t_send must be a finite time, got {t_send!r}")
        is_aux = _field(obj, "aux", bool, "Chunk")
        raw_path = _field(obj, "path", list, "Chunk")
        if any(isinstance(p, bool) or not isinstance(p, int) for p in raw_path):
            raise FrameError(f"Chunk header: path must be node ids, got {raw_path!r}")
        path = tuple(raw_path)
        dtype = _field(obj, "dtype", str, "Chunk")
        if dtype not in WIRE_DTYPES:
            raise FrameError(f"Chunk header: unsupported payload dtype {dtype!r}")
        if is_aux:
            if len(path) < 2 or path[0] != ints["origin"] or path[-1] != ints["final"]:
                raise FrameError(f"Chunk header: auxiliary path {path} does not join origin {ints['origin']} "
                                 f"to final {ints['final']}")
            if len(set(path)) != len(path):
                raise FrameError(f"Chunk header: auxiliary path {path} visits a node twice")
        return cls(ints["it"], ints["chunk"], ints["root"], phase, ints["src"], ints["dst"], ints["origin"],
                   ints["final"], ints["ver"], float(t_send), is_aux, path, ints["count"], dtype)


Header = Hello | ChunkHeader | ErrorFrame


def decode_header(prefix: Prefix, data: bytes | bytearray | memoryview) -> Header:
    """The header a prefix announced; a chunk's payload length must match its count and dtype."""
    header: Header
    if prefix.kind is Kind.HELLO:
        header = Hello.decode(data)
    elif prefix.kind is Kind.ERROR:
        header = ErrorFrame.decode(data)
    else:
        header = ChunkHeader.decode(data)
        if header.payload_len != prefix.payload_len:
            raise FrameError(f"chunk {header.chunk} of iteration {header.iteration}: {header.count} x "
                             f"{header.dtype} needs {header.payload_len} payload bytes, prefix says "
                             f"{prefix.payload_len}")
    return header
