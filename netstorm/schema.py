"""What every wire schema shares: bounded field types and the one way a decode failure becomes typed.

Each wire (``netstorm.control``, ``netstorm.frames``, ``netstorm.trainer_wire``, the policy's wire form
in ``netstorm.policywire``) declares its messages as frozen ``msgspec.Struct`` classes. msgspec checks
types, required and unknown fields and the ``Meta`` bounds below while it decodes, in one pass and
before it builds anything: a declared length beyond the bytes at hand fails as truncated input
without an allocation, and a string or list past its bound fails before it is kept. Checks that
relate fields to each other live in a message's ``__post_init__``, which runs on construction and on
decode alike.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Annotated, Any, Final, TypeVar

import msgspec

from netstorm.errors import NetStormError

MAX_NODE_ID: Final = 2**31 - 1
MAX_COUNT: Final = 2**53
"""Largest count, iteration or version accepted: exact in a float, far beyond any run."""
MAX_NAME: Final = 4096
"""Longest name on a wire: host names, tensor names, layout hashes, shared-memory paths."""
MAX_TEXT: Final = 64 * 1024
"""Longest human-readable text (an error's message, a leave reason)."""
MAX_NODES: Final = 4096
"""Most nodes a list of node ids, a path or a membership may hold."""
MAX_ITEMS: Final = 1 << 20
"""Most entries of a long list (links and their rates, tensors of a model)."""

NodeId = Annotated[int, msgspec.Meta(ge=0, le=MAX_NODE_ID)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
"""An iteration, chunk index, policy version or element count."""
Version = Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNT)]
"""A policy version, or -1 for none."""
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A finite float: the bounds refuse infinities and NaN (which compares false with both)."""
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Path = Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_NODES)]
NodeIds = Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_NODES)]

E = TypeVar("E", bound=NetStormError)


DECODE_ERRORS = (msgspec.MsgspecError, UnicodeDecodeError, RecursionError)
"""What decoding untrusted bytes may raise: msgspec's errors, UnicodeDecodeError for a string that is
not UTF-8 (msgspec lets it through as it is), and RecursionError for input nested deeper than the
interpreter's recursion limit (where a field holds arbitrary msgpack)."""


class _Envelope(msgspec.Struct):
    """A message's version and type, each kept as the raw bytes of its value; every other field is
    skipped, not decoded."""

    v: msgspec.Raw = msgspec.Raw(b"\xc0")
    type: msgspec.Raw = msgspec.Raw(b"\xc0")


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_SCALAR = msgspec.msgpack.Decoder(bool | int | float | Annotated[str, msgspec.Meta(max_length=64)] | None)


SHOWN_BYTES: Final = 64
"""A non-scalar envelope value this short is shown as it is (it holds at most this many objects)."""


def _scalar(raw: msgspec.Raw) -> object:
    try:
        return _SCALAR.decode(raw)
    except DECODE_ERRORS:
        pass
    if len(raw) <= SHOWN_BYTES:
        with contextlib.suppress(*DECODE_ERRORS):
            return msgspec.msgpack.decode(raw)
    return f"<a {len(raw)}-byte value>"


def envelope(data: bytes | bytearray | memoryview) -> tuple[object, object]:
    """The ``v`` and ``type`` of a message that did not decode, to name why (None where absent, a
    description where not a scalar). A hostile message is never decoded as untyped msgpack here: that
    would build every object it holds (a frame of nested empty arrays is tens of millions of lists).
    Raises msgspec.ValidationError when the message is not a map, or another of DECODE_ERRORS."""
    found = _ENVELOPE.decode(data)
    return _scalar(found.v), _scalar(found.type)


def typed_error(error: type[E], what: str, exc: Exception) -> E:
    """``exc`` (one of DECODE_ERRORS) as ``error``, naming ``what`` was decoded; msgspec's own text names
    the field (``at `$.field```) and what it expected."""
    if isinstance(exc, msgspec.ValidationError):
        return error(f"{what}: {exc}")
    if isinstance(exc, RecursionError):
        return error(f"{what} is nested too deeply")
    if isinstance(exc, UnicodeDecodeError):
        return error(f"{what} holds a string that is not UTF-8: {exc}")
    return error(f"{what} is not valid msgpack: {exc}")


class Unstated(int):
    """The version of a message built here rather than decoded: encoded as the wire's version (an int),
    and told apart from a decoded one, whose version is a plain int. A header without ``v`` decodes to
    the default, an Unstated, which is how a decoder tells a missing version from a present one."""


def unstated(version: int) -> Callable[[], int]:
    """The ``default_factory`` of a wire's ``v`` field: always the same Unstated of ``version``.

    A factory rather than a default, so that ``omit_defaults`` never leaves the version off the wire."""
    value = Unstated(version)
    return lambda: value


def stated(version: int) -> bool:
    """Whether a decoded message's ``version`` came from the wire (rather than from the default)."""
    return type(version) is int


def plain(value: Any) -> Any:
    """``value`` with int subclasses (an Unstated version) as plain ints: the encoders' hook for the one
    non-msgpack type a message may hold."""
    if isinstance(value, int):
        return int(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")
