"""Messages between a trainer and its general node (Unix socket or TCP).

Frame: ``<II`` (header length, payload length) + msgpack header + raw payload. The header is a map
with ``v`` (version) and ``type``. Over a Unix socket tensors travel through a shared-memory file and the
payload is empty; over TCP (a trainer on another host of the DC) the float32 values follow inline,
concatenated in the order the message names the tensors.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any, ClassVar

import msgpack

from netstorm.errors import TrainerProtocolError

VERSION = 1
PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20


def _names(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(n, str) for n in value):
        raise TrainerProtocolError(f"{what}: names must be a list of strings, got {value!r}")
    return tuple(value)


def _get(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TrainerProtocolError(f"{what}: field {name!r} must be {getattr(kind, '__name__', kind)}, "
                                   f"got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class InitRequest:
    """Register tensors (name, shape, dtype); ``shm`` is the shared-memory file, "" over TCP."""

    TYPE: ClassVar[str] = "init"
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    shm: str

    def fields(self) -> dict[str, Any]:
        return {"tensors": [[n, list(s), d] for n, s, d in self.tensors], "shm": self.shm}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> InitRequest:
        raw = _get(data, "tensors", list, "init")
        tensors = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                          for d in item[1]) and isinstance(item[2], str)):
                raise TrainerProtocolError(f"init: tensor entries are [name, shape, dtype], got {item!r}")
            tensors.append((item[0], tuple(item[1]), item[2]))
        return cls(tuple(tensors), _get(data, "shm", str, "init"))


@dataclasses.dataclass(frozen=True)
class InitReply:
    TYPE: ClassVar[str] = "init_ok"
    node_id: int
    iteration: int
    num_workers: int
    """Workers whose gradients make up each sum (every DC's trainer and LAN workers)."""
    layout_hash: str

    def fields(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "iteration": self.iteration, "num_workers": self.num_workers,
                "layout_hash": self.layout_hash}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> InitReply:
        return cls(_get(data, "node_id", int, "init_ok"), _get(data, "iteration", int, "init_ok"),
                   _get(data, "num_workers", int, "init_ok"), _get(data, "layout_hash", str, "init_ok"))


@dataclasses.dataclass(frozen=True)
class PushRequest:
    """This DC's values for ``names`` in their next iteration (split form)."""

    TYPE: ClassVar[str] = "push"
    names: tuple[str, ...]

    def fields(self) -> dict[str, Any]:
        return {"names": list(self.names)}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> PushRequest:
        return cls(_names(data.get("names"), "push"))


@dataclasses.dataclass(frozen=True)
class PushReply:
    TYPE: ClassVar[str] = "push_ok"
    iteration: int

    def fields(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> PushReply:
        return cls(_get(data, "iteration", int, "push_ok"))


@dataclasses.dataclass(frozen=True)
class PullRequest:
    """The sums (or means) of ``names`` from the oldest iteration not yet pulled."""

    TYPE: ClassVar[str] = "pull"
    names: tuple[str, ...]
    average: bool

    def fields(self) -> dict[str, Any]:
        return {"names": list(self.names), "average": self.average}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> PullRequest:
        return cls(_names(data.get("names"), "pull"), _get(data, "average", bool, "pull"))


@dataclasses.dataclass(frozen=True)
class PushPullRequest:
    """One synchronous iteration of every registered tensor in a single round trip."""

    TYPE: ClassVar[str] = "push_pull"
    names: tuple[str, ...]
    average: bool

    def fields(self) -> dict[str, Any]:
        return {"names": list(self.names), "average": self.average}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> PushPullRequest:
        return cls(_names(data.get("names"), "push_pull"), _get(data, "average", bool, "push_pull"))


@dataclasses.dataclass(frozen=True)
class PullReply:
    """Results are in shared memory at the tensors' offsets, or inline over TCP."""

    TYPE: ClassVar[str] = "result"
    iteration: int
    names: tuple[str, ...]
    workers: int
    """Workers whose gradients make up these sums: over the iteration's contributing DCs (fewer than the
    job's after a DC died), each DC's trainer and its gateway's LAN workers."""

    def fields(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "names": list(self.names), "workers": self.workers}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> PullReply:
        return cls(_get(data, "iteration", int, "result"), _names(data.get("names"), "result"),
                   _get(data, "workers", int, "result"))


ERROR_KINDS = ("unknown_name", "shape", "dtype", "gone", "timeout", "failed", "protocol")


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    TYPE: ClassVar[str] = "error"
    kind: str
    message: str

    def fields(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> ErrorReply:
        kind = _get(data, "kind", str, "error")
        if kind not in ERROR_KINDS:
            raise TrainerProtocolError(f"error: unknown kind {kind!r}")
        return cls(kind, _get(data, "message", str, "error"))


Message = InitRequest | InitReply | PushRequest | PushReply | PullRequest | PushPullRequest | PullReply | ErrorReply
TYPES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (
    InitRequest, InitReply, PushRequest, PushReply, PullRequest, PushPullRequest, PullReply, ErrorReply)}

FIELDS: dict[type[Message], frozenset[str]] = {
    cls: frozenset({"v", "type", *(f.name for f in dataclasses.fields(cls))}) for cls in TYPES.values()}
"""The keys a header of each type may hold; decoding refuses any other."""


def encode(message: Message, payload_len: int = 0) -> bytes:
    """Prefix and header; ``payload_len`` raw bytes follow."""
    body = msgpack.packb({"v": VERSION, "type": message.TYPE, **message.fields()})
    return PREFIX.pack(len(body), payload_len) + body


def decode_prefix(data: bytes | bytearray, *, max_payload: int) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack(data)
    if header_len > MAX_HEADER_BYTES:
        raise TrainerProtocolError(f"message header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise TrainerProtocolError(f"payload of {payload_len} bytes exceeds the registered model "
                                   f"({max_payload} bytes)")
    return header_len, payload_len


def decode(data: bytes | bytearray) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise TrainerProtocolError(f"message is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise TrainerProtocolError("message must be a map")
    if obj.get("v") != VERSION:
        raise TrainerProtocolError(f"message version {obj.get('v')!r}, this side speaks {VERSION}")
    name = obj.get("type")
    kind = TYPES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise TrainerProtocolError(f"unknown message type {name!r}")
    unknown = sorted(str(k) for k in obj if k not in FIELDS[kind])
    if unknown:
        raise TrainerProtocolError(f"{name}: unknown field(s) {', '.join(unknown)}")
    return kind.from_fields(obj)
