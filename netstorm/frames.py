"""Data-plane frames between general nodes.

A frame is a fixed 14-byte prefix, a msgpack header and a raw little-endian payload::

    magic b"NSF1" | version u8 | kind u8 | header length u32 | payload length u32 | header | payload

The prefix alone tells the receiver how many bytes follow, so the payload can be received straight
into a preallocated numpy array. Every header is a frozen ``msgspec.Struct`` (``netstorm.schema``):
decoding checks types, bounds and fields in one pass and rejects anything unknown with ``FrameError``
before a single payload byte is accepted. The payload is not part of the schema.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, ClassVar, Literal, NamedTuple, TypeVar

import msgspec

from netstorm import auth
from netstorm.errors import ErrorCode, FrameError
from netstorm.schema import DECODE_ERRORS, Count, Finite, NodeId, Path, Text, typed_error

MAGIC = b"NSF1"
VERSION = 1
PREFIX = struct.Struct("<4sBBII")
PREFIX_SIZE = PREFIX.size
MAX_HEADER_BYTES = 16 * 1024
"""A header is a few hundred bytes; anything larger is a broken or hostile peer."""
MAX_LAYOUT_HASH = 64
MAX_CHUNK_ELEMENTS = 1 << 40
"""Bound of a header's element count; the prefix's payload length and max_frame_bytes bound it again."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHUNK = 2
    ERROR = 3


_KINDS = {kind.value: kind for kind in Kind}


class Phase(enum.IntEnum):
    UP = 0
    """Partial sums travelling from children towards the chunk's root."""
    DOWN = 1
    """The full sum travelling from the root back down the same tree."""


class Prefix(NamedTuple):
    """A frame's fixed prefix: a named tuple, built once per frame on the receiving hot path."""

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
    if magic == auth.MAGIC:
        raise FrameError("the peer authenticates with a job secret and this node has none (secret_file): "
                         "authentication failed: wrong or missing secret")
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a NetStorm data-plane peer")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this node speaks {VERSION})")
    kind_value = _KINDS.get(kind)
    if kind_value is None:
        raise FrameError(f"unknown frame kind {kind}")
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(f"header of {header_len} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    if PREFIX_SIZE + header_len + payload_len > max_frame_bytes:
        raise FrameError(f"frame of {PREFIX_SIZE + header_len + payload_len} bytes exceeds "
                         f"max_frame_bytes={max_frame_bytes}")
    if kind_value is not Kind.CHUNK and payload_len:
        raise FrameError(f"{kind_value.name} frame must not carry a payload ({payload_len} bytes)")
    return Prefix(kind_value, header_len, payload_len)


def _frame(kind: Kind, body: bytes, payload_len: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, len(body), payload_len) + body


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of the data-plane headers: immutable, and no field outside the schema decodes."""


class Hello(_Header, frozen=True):
    """First frame of every connection: who the sender is and which layout it serves."""

    KIND: ClassVar[Kind] = Kind.HELLO

    node_id: NodeId
    layout_hash: Annotated[str, msgspec.Meta(max_length=MAX_LAYOUT_HASH)]
    """The sender's layout hash, or "" while its trainer has not registered yet."""

    def encode(self) -> bytes:
        return _frame(Kind.HELLO, _ENCODER.encode(self))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Hello:
        return _decode(_HELLO, data, "Hello")


class ErrorFrame(_Header, frozen=True):
    """Why the receiver is closing the connection; ``code`` says it to a program, ``message`` to people."""

    KIND: ClassVar[Kind] = Kind.ERROR

    message: Text
    code: ErrorCode = ErrorCode.PROTOCOL

    def encode(self) -> bytes:
        return _frame(Kind.ERROR, _ENCODER.encode(self))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ErrorFrame:
        return _decode(_ERROR, data, "Error")


WIRE_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "uint8": 1, "int8": 1, "int16": 2, "int32": 4,
                               "bit": 1}
"""Payload dtypes on the wire (little-endian) and their item sizes. Float chunks travel as float32 (or
float16 with the fp16 compression); integer chunks in the narrowest integer dtype holding the sum, down
to ``bit`` for 0/1 values (packed eight to a byte, most significant bit first: ``np.packbits``)."""

WIRE_FORMATS: dict[str, str] = {"float32": "<f4", "float16": "<f2", "uint8": "u1", "int8": "i1",
                                "int16": "<i2", "int32": "<i4", "bit": "u1"}
"""The numpy format of each wire dtype's payload items, for receiving a payload straight into an array."""

FLOAT_WIRE = frozenset({"float32", "float16"})

WireDtype = Literal["float32", "float16", "uint8", "int8", "int16", "int32", "bit"]


class ChunkHeader(_Header, frozen=True):
    """One hop of one chunk.

    ``origin`` and ``final`` are the ends of the tree edge the chunk travels; ``src`` and ``dst`` are
    this hop's ends. On the primary path they coincide; an auxiliary chunk carries ``is_aux`` and the
    source-chosen ``path`` (origin ... final) that every intermediate node follows. On the wire the
    header is a msgpack map under the short keys the ``name=`` of a field gives.
    """

    KIND: ClassVar[Kind] = Kind.CHUNK

    iteration: Count = msgspec.field(name="it")
    chunk: Count
    root: NodeId
    phase: Phase
    src: NodeId
    dst: NodeId
    origin: NodeId
    final: NodeId
    version: Count = msgspec.field(name="ver")
    t_send: Finite
    is_aux: bool = msgspec.field(name="aux")
    path: Path
    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHUNK_ELEMENTS)]
    """Elements in the payload: the chunk's leading elements; the rest of the chunk is zero (a sender
    elides the all-zero tail, so sparse chunks cost what they hold)."""
    dtype: WireDtype = "float32"

    def __post_init__(self) -> None:
        if self.is_aux:
            path = self.path
            if len(path) < 2 or path[0] != self.origin or path[-1] != self.final:
                raise FrameError(f"Chunk header: auxiliary path {path} does not join origin {self.origin} "
                                 f"to final {self.final}")
            if len(set(path)) != len(path):
                raise FrameError(f"Chunk header: auxiliary path {path} visits a node twice")

    @property
    def payload_items(self) -> int:
        """Items of the payload array: ``count``, or the bytes that pack ``count`` bits."""
        return (self.count + 7) // 8 if self.dtype == "bit" else self.count

    @property
    def payload_len(self) -> int:
        return self.payload_items * WIRE_DTYPES[self.dtype]

    def hop(self, src: int, dst: int, t_send: float) -> ChunkHeader:
        """The same chunk on its next hop."""
        return msgspec.structs.replace(self, src=src, dst=dst, t_send=t_send)

    def encode(self) -> bytes:
        """Prefix and header; the payload follows as raw bytes."""
        return _frame(Kind.CHUNK, _ENCODER.encode(self), self.payload_len)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ChunkHeader:
        return _decode(_CHUNK, data, "Chunk")


def frame_size(header: ChunkHeader) -> int:
    """Bytes a chunk frame takes on the wire: prefix, header and payload (what ``wan_bytes`` counts)."""
    return PREFIX_SIZE + len(_ENCODER.encode(header)) + header.payload_len


_ENCODER = msgspec.msgpack.Encoder()
_HELLO = msgspec.msgpack.Decoder(Hello)
_ERROR = msgspec.msgpack.Decoder(ErrorFrame)
_CHUNK = msgspec.msgpack.Decoder(ChunkHeader)
H = TypeVar("H", Hello, ErrorFrame, ChunkHeader)


def _decode(decoder: msgspec.msgpack.Decoder[H], data: bytes | bytearray | memoryview, what: str) -> H:
    try:
        return decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise typed_error(FrameError, f"{what} header", exc) from None


Header = Hello | ChunkHeader | ErrorFrame


def decode_header(prefix: Prefix, data: bytes | bytearray | memoryview) -> Header:
    """The header a prefix announced; a chunk's payload length must match its count and dtype."""
    if prefix.kind is not Kind.CHUNK:
        return Hello.decode(data) if prefix.kind is Kind.HELLO else ErrorFrame.decode(data)
    try:
        header = _CHUNK.decode(data)
    except DECODE_ERRORS as exc:
        raise typed_error(FrameError, "Chunk header", exc) from None
    if header.payload_len != prefix.payload_len:
            raise FrameError(f"chunk {header.chunk} of iteration {header.iteration}: {header.count} x "
                             f"{header.dtype} needs {header.payload_len} payload bytes, prefix says "
                             f"{prefix.payload_len}")
    return header
