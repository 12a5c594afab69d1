"""The schema of a policy's wire form: what ``Policy.to_wire`` writes and ``Policy.from_wire`` reads.

The form is JSON- and msgpack-safe: string keys, node ids as decimal strings, directed links as
``"<src>-><dst>"``. ``parse`` validates a decoded form (from either codec) against ``PolicyWire`` in one
pass: types, required and unknown keys, node ids and the link keys' pattern. What relates its parts
(trees span the same nodes, shares sum to one, paths are simple) is ``Policy.validate``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from netstorm.errors import PolicyError
from netstorm.schema import DECODE_ERRORS, MAX_ITEMS, MAX_NODES, Count, NodeId, Path, typed_error

WIRE_VERSION = 1

LINK_PATTERN = r"^(-?(?:0|[1-9][0-9]*))->(-?(?:0|[1-9][0-9]*))$"
Link = Annotated[str, msgspec.Meta(pattern=LINK_PATTERN)]
"""A directed link as a key: ``"<src>-><dst>"``."""
Paths = Annotated[tuple[Path, ...], msgspec.Meta(max_length=MAX_NODES)]
Moves = Annotated[tuple[tuple[Path, float], ...], msgspec.Meta(max_length=MAX_NODES)]
ByNode = Annotated[dict[int, float], msgspec.Meta(max_length=MAX_NODES)]


class PolicyWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One policy as it travels. ``rates``, ``explore`` and ``offload`` are left off while empty, so
    builds that predate them read the policy."""

    wire: int
    version: Count
    topology: Annotated[str, msgspec.Meta(max_length=16)]
    roots: Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_NODES)]
    trees: Annotated[dict[int, dict[int, NodeId | None]], msgspec.Meta(max_length=MAX_NODES)]
    chunk_share: ByNode
    quality: ByNode
    aux_paths: Annotated[dict[Link, Paths], msgspec.Meta(max_length=MAX_ITEMS)]
    rates: Annotated[dict[Link, float], msgspec.Meta(max_length=MAX_ITEMS)] = {}
    explore: Annotated[tuple[Link, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    offload: Annotated[dict[Link, Moves], msgspec.Meta(max_length=MAX_ITEMS)] = {}


NodeKey = Annotated[str, msgspec.Meta(pattern=r"^-?(?:0|[1-9][0-9]*)$", max_length=11)]
"""A node id as ``to_wire`` writes it in a key: a decimal string."""
ByNodeKey = Annotated[dict[NodeKey, float], msgspec.Meta(max_length=MAX_NODES)]


PathList = Annotated[list[NodeId], msgspec.Meta(max_length=MAX_NODES)]
MoveRow = Annotated[list[PathList | float], msgspec.Meta(min_length=2, max_length=2)]
"""[path, fraction], as ``to_wire`` writes a move (``parse`` checks which is which)."""


class PolicyForm(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``PolicyWire`` as msgpack carries it, in ``to_wire``'s shapes (lists, node ids as decimal-string
    keys): the type a control frame's policy decodes into, so that it is typed and bounded while it
    decodes; its builtin form equals what ``to_wire`` wrote, and ``parse`` reads that."""

    wire: int
    version: Count
    topology: Annotated[str, msgspec.Meta(max_length=16)]
    roots: Annotated[list[NodeId], msgspec.Meta(max_length=MAX_NODES)]
    trees: Annotated[dict[NodeKey, Annotated[dict[NodeKey, NodeId | None], msgspec.Meta(max_length=MAX_NODES)]],
                     msgspec.Meta(max_length=MAX_NODES)]
    chunk_share: ByNodeKey
    quality: ByNodeKey
    aux_paths: Annotated[dict[Link, Annotated[list[PathList], msgspec.Meta(max_length=MAX_NODES)]],
                         msgspec.Meta(max_length=MAX_ITEMS)]
    rates: Annotated[dict[Link, float], msgspec.Meta(max_length=MAX_ITEMS)] = {}
    explore: Annotated[list[Link], msgspec.Meta(max_length=MAX_ITEMS)] = []
    offload: Annotated[dict[Link, Annotated[list[MoveRow], msgspec.Meta(max_length=MAX_NODES)]],
                       msgspec.Meta(max_length=MAX_ITEMS)] = {}


def parse(data: Mapping[str, Any]) -> PolicyWire:
    """``data`` (a decoded wire form) as a PolicyWire; PolicyError names what does not fit."""
    try:
        form = msgspec.convert(data, PolicyWire, str_keys=True)
    except DECODE_ERRORS as exc:
        raise typed_error(PolicyError, "policy", exc) from None
    if form.wire != WIRE_VERSION:
        raise PolicyError(f"unsupported policy wire version {form.wire!r} (this build reads {WIRE_VERSION})")
    return form


def link(key: str) -> tuple[int, int]:
    """``"<src>-><dst>"`` (a key ``parse`` has matched against LINK_PATTERN) as (src, dst)."""
    src, _, dst = key.partition("->")
    return int(src), int(dst)
