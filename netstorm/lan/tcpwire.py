"""The LAN tier's TCP path (``edge_mode=tcp``): its frames, defined once, and a reader that validates each
frame before it allocates or reads its payload.

Over veth and a bridge, TCP moves 64 KB segments whole (TSO/GSO), where the UDP paths move one datagram
per MTU; a worker therefore streams each tensor to the gateway in large DATA frames and gets the result
back in large RESULT frames over the same connection. A frame is a fixed prefix (``PREFIX``: magic,
version, header length, payload length), a msgpack header (one tagged union, ``Message``) and a raw
payload (lanes or float32 results) that lands straight in a numpy buffer.

Every frame is authenticated as the LAN datagrams are (``netstorm/lan/tokens.py``): HELLO carries the
worker's token over a fresh nonce, the WELCOME the gateway's token over it; every DATA frame the worker's
token of its iteration and every RESULT the gateway's token for that worker and iteration. The gateway
also binds a connection to the worker its first valid HELLO named: a frame naming another worker on it is
refused. Without a secret every token is 0 and only the binding holds.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Annotated, Final

import msgspec
import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.header import MAX_LANES, MAX_WORKERS, Precision
from netstorm.schema import DECODE_ERRORS, Text, typed_error

MAGIC: Final = b"NSLT"
VERSION: Final = 1
PREFIX: Final = struct.Struct("<4sBxHI")
"""magic, version, (reserved), header length, payload length."""
MAX_HEADER: Final = 1024
"""Longest msgpack header: a HELLO with a few dozen tensors' sizes; a model of more tensors is refused."""
MAX_TENSORS: Final = 64
SEGMENT_CHUNKS: Final = 512
"""LAN chunks (``lanes`` elements each, the UDP paths' chunk) per DATA and RESULT frame: about 730 KB of
fp32 lanes at MTU 1500, so a frame is many TCP segments and the per-frame Python work is amortised. Frames
start on chunk boundaries so int8's per-chunk scales are the UDP paths' exactly."""
MAX_ELEMENTS: Final = 2**31 - 1
MAX_RESULT_PAYLOAD: Final = SEGMENT_CHUNKS * MAX_LANES * 4
"""Largest RESULT payload a worker accepts before it knows the gateway's frame size."""
MAX_WIDE: Final = 2**56
"""Largest magnitude of a fixed-point lane (exclusive): 64 workers' sums of such lanes stay in int64."""

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""A token: msgpack integers stop at 2**64 - 1 by themselves."""
Job = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
Worker = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORKERS)]
Tensor = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TENSORS)]
Elements = Annotated[int, msgspec.Meta(ge=0, le=MAX_ELEMENTS)]
Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_ELEMENTS)]
Scale = Annotated[int, msgspec.Meta(ge=-128, le=127)]
Lanes = Annotated[int, msgspec.Meta(ge=1, le=MAX_LANES)]
Count = Annotated[int, msgspec.Meta(ge=1, le=SEGMENT_CHUNKS * MAX_LANES)]
PrecisionCode = Annotated[int, msgspec.Meta(ge=0, le=int(max(Precision)))]


class Refused(enum.StrEnum):
    """Why one side closed the connection (the ``code`` of a REFUSAL)."""

    MALFORMED = "malformed"
    """The bytes are not a frame of this wire (prefix, header or a payload length that does not fit)."""
    FORGED = "forged"
    """A token that is not the sender's for that iteration, or a frame naming another worker."""
    PROTOCOL = "protocol"
    """A valid frame at the wrong moment: out of order, an unknown iteration, a model that differs."""


class Message(msgspec.Struct, frozen=True, tag_field="kind", array_like=True, forbid_unknown_fields=True):
    """Base of the TCP path's frame headers."""


class Hello(Message, frozen=True, tag="hello"):
    """Worker -> gateway, first frame: who it is and the model it will send."""

    job: Job
    worker: Worker
    nonce: U32
    token: U64
    """The worker's token over ``nonce`` (0 without a secret)."""
    sizes: Annotated[tuple[Size, ...], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]
    precision: PrecisionCode


class Welcome(Message, frozen=True, tag="welcome"):
    """Gateway -> worker: the deployment (per-tensor fixed-point scales, the chunk width, frame size)."""

    worker: Worker
    nonce: U32
    token: U64
    """The gateway's token for this worker over the HELLO's nonce."""
    scales: Annotated[tuple[Scale, ...], msgspec.Meta(min_length=1, max_length=MAX_TENSORS)]
    lanes: Lanes
    segment: Count
    """Elements per DATA/RESULT frame: ``SEGMENT_CHUNKS * lanes`` (the last frame of a tensor is shorter)."""

    def __post_init__(self) -> None:
        if self.segment % self.lanes:
            raise WireError(f"segment {self.segment} is not a multiple of {self.lanes} lanes")


class Data(Message, frozen=True, tag="data"):
    """Worker -> gateway: lanes of one tensor's elements [offset, offset + count) for an iteration."""

    worker: Worker
    iteration: U32
    tensor: Tensor
    offset: Elements
    count: Count
    precision: PrecisionCode
    wide: bool
    """FIXED32 lanes that do not fit int32 at the scale travel as int64 (this frame only)."""
    token: U64

    def payload_bytes(self, lanes: int) -> int:
        """The payload's exact length: the lanes, after one int8 scale per chunk for INT8."""
        precision = Precision(self.precision)
        if precision == Precision.INT8:
            return -(-self.count // lanes) + self.count
        return self.count * (8 if self.wide else precision.lane_bytes)

    def __post_init__(self) -> None:
        if self.wide and self.precision != Precision.FIXED32:
            raise WireError("only fixed-point lanes travel wide")


class Result(Message, frozen=True, tag="result"):
    """Gateway -> worker: float32 result elements [offset, offset + count) of one tensor."""

    worker: Worker
    iteration: U32
    tensor: Tensor
    offset: Elements
    count: Count
    total: U32
    """Workers whose gradients the result sums (every DC's), as the UDP RESULT's ``total``."""
    token: U64


class Refusal(Message, frozen=True, tag="refusal"):
    """Either side, last frame: why the connection closes."""

    code: Refused
    message: Text


Frame = Hello | Welcome | Data | Result | Refusal
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(message: Message, payload_bytes: int = 0) -> bytes:
    """Prefix and header of a frame whose payload (``payload_bytes`` long) the caller writes after it."""
    body = _encoder.encode(message)
    if len(body) > MAX_HEADER:
        raise WireError(f"a {type(message).__name__} header of {len(body)} bytes exceeds {MAX_HEADER}")
    return PREFIX.pack(MAGIC, VERSION, len(body), payload_bytes) + body


def decode_header(body: bytes | memoryview) -> Frame:
    try:
        return _decoder.decode(body)
    except WireError:
        raise
    except DECODE_ERRORS as exc:
        raise typed_error(WireError, "TCP edge frame header", exc) from None


Expect = Callable[[Frame, int], memoryview | None]
"""Called with a decoded header and its payload's length before any payload byte is read: raises
WireError to refuse the frame, or returns where the payload goes (exactly that long; None: a scratch
buffer the reader owns, valid until the next ``buffer()``)."""


class FrameReader:
    """Sans-I/O reader of one connection's frames, made for ``asyncio.BufferedProtocol``: ``buffer()`` is
    where the next bytes go, ``advance(n)`` says how many arrived and returns the frames they completed.

    Every length is checked before anything is sized by it: the prefix's header length against
    ``MAX_HEADER``, its payload length against ``max_payload`` (which the owner raises once it knows the
    model), then the header's own claim through ``expect``. A payload is received straight into the
    buffer ``expect`` names (the worker's result array) or into one scratch buffer reused frame after
    frame, so a connection holds at most ``max_payload`` bytes whatever it is sent."""

    def __init__(self, expect: Expect, *, max_payload: int = 0) -> None:
        self.expect = expect
        self.max_payload = max_payload
        self._prefix = bytearray(PREFIX.size)
        self._header = bytearray(MAX_HEADER)
        self._scratch = bytearray(0)
        self._target = memoryview(self._prefix)
        self._at = 0
        self._state = 0   # 0: prefix, 1: header, 2: payload
        self._message: Frame | None = None
        self._payload_len = 0

    def buffer(self) -> memoryview:
        return self._target[self._at:]

    def advance(self, n: int) -> list[tuple[Frame, memoryview]]:
        """``n`` bytes were written into ``buffer()``; the frames now complete (each payload a view that
        stays valid until the next ``buffer()`` call)."""
        self._at += n
        out: list[tuple[Frame, memoryview]] = []
        if self._at < len(self._target):
            return out
        if self._state == 0:
            magic, version, header_len, payload_len = PREFIX.unpack(self._prefix)
            if magic != MAGIC:
                raise WireError(f"not a TCP edge frame (magic {bytes(magic)!r})")
            if version != VERSION:
                raise WireError(f"TCP edge frame version {version}, this side speaks {VERSION}")
            if not 0 < header_len <= MAX_HEADER:
                raise WireError(f"TCP edge frame header of {header_len} bytes (1..{MAX_HEADER})")
            if payload_len > self.max_payload:
                raise WireError(f"TCP edge frame payload of {payload_len} bytes exceeds {self.max_payload}")
            self._payload_len = payload_len
            self._goto(1, memoryview(self._header)[:header_len])
        elif self._state == 1:
            message = decode_header(self._target)
            target = self.expect(message, self._payload_len)
            if target is None:
                if len(self._scratch) < self._payload_len:
                    self._scratch = bytearray(self.max_payload)
                target = memoryview(self._scratch)[: self._payload_len]
            elif target.nbytes != self._payload_len:
                raise ValueError(f"payload buffer of {target.nbytes} bytes for a {self._payload_len}-byte payload")
            self._message = message
            self._goto(2, target.cast("B") if target.format != "B" else target)
            if self._payload_len == 0:
                return self.advance(0)
        else:
            assert self._message is not None
            out.append((self._message, self._target))
            self._message = None
            self._goto(0, memoryview(self._prefix))
        return out

    def _goto(self, state: int, target: memoryview) -> None:
        self._state, self._target, self._at = state, target, 0


def frame_bounds(size: int, segment: int) -> list[tuple[int, int]]:
    """(offset, count) of a tensor's frames: ``segment`` elements each, the last shorter."""
    return [(a, min(segment, size - a)) for a in range(0, max(size, 1), segment)]


def fixed_lanes(values: np.ndarray, scale: int) -> tuple[np.ndarray, bool]:
    """A worker's fp32 values as fixed-point lanes at ``scale``: int32, or int64 (``wide``) where a value
    does not fit int32 there; WireError for values no lane holds (inf, nan, or beyond ``MAX_WIDE``)."""
    scaled = np.rint(np.asarray(values, np.float64) * 2.0**scale)
    peak = float(np.max(np.abs(scaled), initial=0.0))
    if not peak < MAX_WIDE:   # also false for nan
        raise WireError(f"gradient values reach {peak:g} at scale {scale}: beyond fixed point (or inf/nan)")
    if peak <= 2**31 - 1:
        return scaled.astype("<i4"), False
    return scaled.astype("<i8"), True
