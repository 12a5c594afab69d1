"""Messages between a trainer and its general node (Unix socket or TCP).

Frame: ``<II`` (header length, payload length) + msgpack header + raw payload. The header is a map
with ``v`` (version), ``type`` and the message's fields: a tagged union of frozen ``msgspec.Struct``
classes (``netstorm.schema``) decoded and validated in one pass. Over a Unix socket tensors travel
through a shared-memory file and the payload is empty; over TCP (a trainer on another host of the DC)
the float32 values follow inline, concatenated in the order the message names the tensors. The
payload is not part of the schema.

A failed request is answered by an ``ErrorReply`` whose ``kind`` is the ``ErrorCode`` of what the node
raised; the client raises the exception class of that code.
"""

from __future__ import annotations

import struct
from typing import Annotated, ClassVar

import msgspec

from netstorm.compression.methods import WireName as CompressionName
from netstorm.errors import ErrorCode, TrainerProtocolError
from netstorm.schema import (
    DECODE_ERRORS,
    MAX_ITEMS,
    Count,
    Name,
    NodeId,
    Text,
    Version,
    envelope,
    plain,
    stated,
    typed_error,
    unstated,
)

VERSION = 1
PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 32
"""Most dimensions of a registered tensor."""


Names = Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_ITEMS)]
NodeIds = Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_ITEMS)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Shape = Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_DIMS)]
Dtype = Annotated[str, msgspec.Meta(max_length=32)]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True,
               omit_defaults=True, gc=False):
    """Base of every trainer-wire message: ``v`` is written by the encoder and checked at decode."""

    TYPE: ClassVar[str] = ""
    v: int = msgspec.field(default_factory=unstated(VERSION))

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise TrainerProtocolError(f"message version {self.v!r}, this side speaks {VERSION}")


class InitRequest(_Message, frozen=True, tag="init"):
    """Register tensors (name, shape, dtype); ``shm`` is the shared-memory file, "" over TCP or with ``fd``."""

    tensors: Annotated[tuple[tuple[Name, Shape, Dtype], ...], msgspec.Meta(max_length=MAX_ITEMS)]
    shm: Name
    compression: CompressionName = "none"
    """The job's compression as this trainer runs it (a name of ``COMPRESSION``): a ``float16`` method makes
    the nodes send float chunks as float16, a ``consensus`` one has the roots threshold the vote counts
    (the rest runs in the trainer)."""
    votes: Count = 0
    """FediAC's threshold a (``fediac_votes``; 0: derived from the job's workers as the trainer would)."""
    bits: Count = 0
    """FediAC's b as the trainer runs it (0: derived from a dense first round): a gateway's LAN tier
    derives each round's wire from it (``netstorm/lan/introunds.py``)."""
    gia_reuse: Count = 1
    """Iterations one FediAC GIA serves (``fediac_gia_reuse``): a gateway's LAN tier plans the reused
    iterations' wires by it."""
    fd: Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)] = -1
    """Over a Unix socket, the trainer's descriptor of its anonymous model memory (a memfd), which the node
    opens through ``/proc/<trainer pid>/fd``; -1: ``shm`` names a file instead."""


class InitReply(_Message, frozen=True, tag="init_ok"):
    node_id: NodeId
    iteration: Count
    num_workers: Count
    """Workers whose gradients make up each sum (every DC's trainer and LAN workers)."""
    layout_hash: Name
    contributors: NodeIds = ()
    """The DCs whose values the returned model holds (empty for a replacement trainer's init, which
    gets its own values back)."""
    gia_threshold: Count = 0
    """The threshold a the roots apply to FediAC's vote counts (0: none; the sums come back as counts)."""


class PushRequest(_Message, frozen=True, tag="push"):
    """This DC's values for ``names`` in their next iteration (split form)."""

    names: Names


class PushReply(_Message, frozen=True, tag="push_ok"):
    iteration: Version
    """The iteration the values entered (-1 when ``names`` was empty)."""


class PullRequest(_Message, frozen=True, tag="pull"):
    """The sums (or means) of ``names`` from the oldest iteration not yet pulled; with ``push``, this
    DC's values for ``names`` come first (inline or in shared memory), so one round trip makes one
    synchronous iteration."""

    names: Names
    average: bool
    push: bool = False


class PullReply(_Message, frozen=True, tag="result"):
    """Results are in shared memory at the tensors' offsets, or inline over TCP."""

    iteration: Version
    names: Names
    workers: Count
    """Workers whose gradients make up these sums: over the iteration's contributing DCs (fewer than the
    job's after a DC died), each DC's trainer and its gateway's LAN workers."""
    contributors: NodeIds = ()
    """The DCs whose gradients these sums hold: the membership the scheduler bound to the iteration."""
    wan_bytes: Count = 0
    """Bytes this DC's node queued on WAN links for the iteration so far (prefix, header and payload of
    every chunk frame, relays included); summed over the DCs, the iteration's WAN traffic."""


class ModelWanted(_Message, frozen=True, tag="model_wanted"):
    """The node's answer to a push that starts ``iteration``, when that iteration hands the live model
    to DCs admitted into the job and this DC provides it: the trainer sends ``ModelOffer`` (its current
    values of every registered tensor, from its model provider), then gets the push's own reply."""

    iteration: Version


class ModelOffer(_Message, frozen=True, tag="model_offer"):
    """The trainer's current model: every registered tensor inline, as float32 in layout order."""

    iteration: Version


class Bye(_Message, frozen=True, tag="bye"):
    """The trainer closes on purpose (``close()``; its job is over): its place is free, and, unlike a
    trainer that died, the DC's next iteration waits for a replacement instead of failing at once."""


class ErrorReply(_Message, frozen=True, tag="error"):
    """The request failed: ``kind`` names why for the client's program, ``message`` for people."""

    kind: ErrorCode
    message: Text


Message = (InitRequest | InitReply | PushRequest | PushReply | PullRequest | PullReply | ModelWanted | ModelOffer
           | Bye | ErrorReply)
TYPES: dict[str, type[Message]] = {}
for _cls in (InitRequest, InitReply, PushRequest, PushReply, PullRequest, PullReply, ModelWanted, ModelOffer,
             Bye, ErrorReply):
    _cls.TYPE = str(_cls.__struct_config__.tag)
    TYPES[_cls.TYPE] = _cls

_ENCODER = msgspec.msgpack.Encoder(enc_hook=plain)
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(message: Message, payload_len: int = 0) -> bytes:
    """Prefix and header; ``payload_len`` raw bytes follow."""
    body = _ENCODER.encode(message)
    return PREFIX.pack(len(body), payload_len) + body


def decode_prefix(data: bytes | bytearray, *, max_payload: int) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack(data)
    if header_len > MAX_HEADER_BYTES:
        raise TrainerProtocolError(f"message header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise TrainerProtocolError(f"payload of {payload_len} bytes exceeds the registered model "
                                   f"({max_payload} bytes)")
    return header_len, payload_len


def decode(data: bytes | bytearray | memoryview) -> Message:
    """One message from a header; TrainerProtocolError names what is wrong."""
    try:
        message = _DECODER.decode(data)
    except DECODE_ERRORS as exc:
        raise _diagnose(data, exc) from None
    if not stated(message.v):
        raise TrainerProtocolError(f"message version None, this side speaks {VERSION}")
    return message


def _diagnose(data: bytes | bytearray | memoryview, exc: Exception) -> TrainerProtocolError:
    """Why a header did not decode, in the words of its envelope (map, version, type) before its fields';
    only the envelope is decoded again, never the header as untyped msgpack."""
    try:
        version, name = envelope(data)
    except msgspec.ValidationError:
        return TrainerProtocolError("message must be a map")
    except DECODE_ERRORS as undecodable:
        return typed_error(TrainerProtocolError, "message", undecodable)
    if version != VERSION or isinstance(version, bool):
        return TrainerProtocolError(f"message version {version!r}, this side speaks {VERSION}")
    if not isinstance(name, str) or name not in TYPES:
        return TrainerProtocolError(f"unknown message type {name!r}")
    return typed_error(TrainerProtocolError, name, exc)
