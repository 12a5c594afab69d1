"""Control-plane messages between nodes and the scheduler, and their framing.

A frame is a 4-byte little-endian body length followed by a msgpack map holding ``"v"`` (the
protocol version), ``"type"`` and the message's fields. Every message is a frozen dataclass with an
explicit ``to_fields`` / ``from_fields`` pair; decoding checks every field's type and rejects unknown
types, versions and fields with a ``ControlError`` naming the problem, so a confused or hostile peer
gets a clear answer instead of a half-built object.

Replies on one connection come back in request order (the scheduler answers each request before it
reads the next), which is how the client pairs an ``Error`` with the request that caused it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import msgpack

from netstorm.errors import NetStormError

T = TypeVar("T")

VERSION = 1
LENGTH = struct.Struct("<I")
MAX_CONTROL_FRAME = 64 * 1024 * 1024
"""Largest control frame body accepted: a 200-node policy with auxiliary paths fits comfortably."""


class ControlError(NetStormError):
    """A control message is malformed or unknown, or the scheduler refused a request."""


class ControlTimeout(ControlError, TimeoutError):
    """A control-plane request did not complete in time; the message names the peer and iteration."""


class LayoutMismatch(ControlError):
    """This node's tensor layout differs from the one the first node registered."""


# --- field checkers: raise ControlError naming the message and field ------------------------------

Checker = Callable[[str, Any], Any]


def _int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(f"{where}: expected an integer, got {value!r}")
    return value


def _float(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ControlError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ControlError(f"{where}: expected true or false, got {value!r}")
    return value


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ControlError(f"{where}: expected a string, got {value!r}")
    return value


def _port(where: str, value: Any) -> int:
    port = _int(where, value)
    if not 0 < port < 65536:
        raise ControlError(f"{where}: port {port} out of range")
    return port


def _dict(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ControlError(f"{where}: expected a map with string keys, got {type(value).__name__}")
    return value


def _opt_dict(where: str, value: Any) -> dict[str, Any] | None:
    return None if value is None else _dict(where, value)


def _rows(where: str, value: Any, shape: str) -> list[list[Any]]:
    """``value`` as a list of lists with as many fields as ``shape`` (such as "[id, host, port]") names."""
    if not isinstance(value, list):
        raise ControlError(f"{where}: expected a list of {shape}, got {type(value).__name__}")
    width = shape.count(",") + 1
    for entry in value:
        if not isinstance(entry, list) or len(entry) != width:
            raise ControlError(f"{where}: expected {shape}, got {entry!r}")
    return value


def _by_node(where: str, value: Any, shape: str, convert: Callable[[int, list[Any]], T]) -> dict[int, T]:
    """Rows keyed by their first field, a node id that may appear once; ``convert`` takes the rest."""
    out: dict[int, T] = {}
    for entry in _rows(where, value, shape):
        node_id = _int(where, entry[0])
        if node_id in out:
            raise ControlError(f"{where}: node {node_id} listed twice")
        out[node_id] = convert(node_id, entry[1:])
    return out


def _members(where: str, value: Any) -> dict[int, tuple[str, int]]:
    return _by_node(where, value, "[id, host, port]", lambda _, rest: (_str(where, rest[0]), _port(where, rest[1])))


def _rates(where: str, value: Any) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for entry in _rows(where, value, "[src, dst, mbit_s]"):
        rate = _float(where, entry[2])
        if not rate > 0:
            raise ControlError(f"{where}: rate of {entry[0]}->{entry[1]} must be positive, got {rate}")
        out[(_int(where, entry[0]), _int(where, entry[1]))] = rate
    return out


def _moves(where: str, value: Any) -> dict[tuple[int, int], tuple[tuple[tuple[int, ...], float], ...]]:
    """Planned offload rows [src, dst, path, fraction]: a simple detour from src to dst and the share
    of the link's chunks it carries, at most 1 in all per link."""
    out: dict[tuple[int, int], list[tuple[tuple[int, ...], float]]] = {}
    for src, dst, path, fraction in _rows(where, value, "[src, dst, path, fraction]"):
        link = (_int(where, src), _int(where, dst))
        if not isinstance(path, list) or len(path) < 3:
            raise ControlError(f"{where}: path of {link[0]}->{link[1]} must list at least three nodes, got {path!r}")
        hops = tuple(_int(where, node) for node in path)
        if hops[0] != link[0] or hops[-1] != link[1] or len(set(hops)) != len(hops):
            raise ControlError(f"{where}: {list(hops)} is not a simple detour from {link[0]} to {link[1]}")
        share = _float(where, fraction)
        if not 0 < share <= 1:
            raise ControlError(f"{where}: fraction of {list(hops)} must be in (0, 1], got {share}")
        out.setdefault(link, []).append((hops, share))
    for link, paths in out.items():
        if sum(share for _, share in paths) > 1 + 1e-9:
            raise ControlError(f"{where}: fractions of {link[0]}->{link[1]} sum above 1")
    return {link: tuple(paths) for link, paths in out.items()}


def _pairs(where: str, value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise ControlError(f"{where}: expected a list of [int, int] pairs, got {value!r}")
    return tuple((_int(where, a), _int(where, b)) for a, b in value)


def _workers(where: str, value: Any) -> int:
    count = _int(where, value)
    if count < 1:
        raise ControlError(f"{where}: a DC contributes at least its own trainer (1 worker), got {count}")
    return count


def _worker_counts(where: str, value: Any) -> dict[int, int]:
    return _by_node(where, value, "[id, workers]", lambda node_id, rest: _workers(f"{where}[{node_id}]", rest[0]))


def _edge_modes(where: str, value: Any) -> dict[int, tuple[str, str]]:
    return _by_node(where, value, "[id, mode, fallback]", lambda _, rest: (_str(where, rest[0]), _str(where, rest[1])))


def _policy_records(where: str, value: Any) -> tuple[PolicyRecord, ...]:
    """Rows [version, reason, roots, edges], each edge [root, child, parent]."""
    out: list[PolicyRecord] = []
    for version, reason, roots, edges in _rows(where, value, "[version, reason, roots, edges]"):
        if not isinstance(edges, list) or not all(isinstance(e, list) and len(e) == 3 for e in edges):
            raise ControlError(f"{where}: edges of version {version!r} must be [root, child, parent] rows")
        out.append(PolicyRecord(_int(where, version), _str(where, reason), _ids(where, roots),
                                tuple((_int(where, r), _int(where, c), _int(where, p)) for r, c, p in edges)))
    return tuple(out)


def _ids(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ControlError(f"{where}: expected a list of node ids, got {type(value).__name__}")
    return tuple(_int(where, v) for v in value)


# --- messages ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every control message; subclasses set TYPE and FIELDS (name -> checker).

    A field named in OPTIONAL may be absent from a frame (the dataclass default applies): fields added
    after a message was first defined are optional, and are left out of the frame while they hold their
    default, so peers that predate them still decode what a newer peer sends when the feature is unused.
    """

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[Mapping[str, Checker]] = {}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def to_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_fields(cls, data: Mapping[str, Any]) -> Message:
        values = {name: check(f"{cls.TYPE}.{name}", data[name]) for name, check in cls.FIELDS.items()
                  if name in data or name not in cls.OPTIONAL}
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Register(Message):
    TYPE: ClassVar[str] = "register"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "data_host": _str, "data_port": _port,
                                                "workers": _workers}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"workers"})
    node_id: int
    data_host: str
    data_port: int
    workers: int = 1
    """Workers whose gradients this DC's contribution sums: its own trainer and the LAN workers its
    gateway aggregates (``netstorm node --edge-workers``)."""

    def __post_init__(self) -> None:
        _workers(f"{self.TYPE}.workers", self.workers)

    def to_fields(self) -> dict[str, Any]:
        fields = super().to_fields()
        if self.workers == 1:
            del fields["workers"]
        return fields


@dataclasses.dataclass(frozen=True)
class RegisterAck(Message):
    """Sent to every node once all expected nodes have registered."""

    TYPE: ClassVar[str] = "register_ack"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"members": _members, "config": _dict, "scheduler_time": _float,
                                                "workers": _worker_counts}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"workers"})
    members: Mapping[int, tuple[str, int]]
    config: Mapping[str, Any]
    scheduler_time: float
    workers: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Member -> workers its contribution sums (Register.workers). Kept, and sent, only where it is not
    1, so an ack naming every member with 1 equals one naming none; ``workers_of`` reads it."""

    def __post_init__(self) -> None:
        strangers = sorted(set(self.workers) - set(self.members))
        if strangers:
            raise ControlError(f"{self.TYPE}.workers: node(s) {strangers} are not members")
        counts = {n: _workers(f"{self.TYPE}.workers[{n}]", w) for n, w in sorted(self.workers.items())}
        object.__setattr__(self, "workers", {n: w for n, w in counts.items() if w != 1})

    def workers_of(self, node_id: int) -> int:
        return self.workers.get(node_id, 1)

    def to_fields(self) -> dict[str, Any]:
        members = [[node_id, host, port] for node_id, (host, port) in sorted(self.members.items())]
        fields: dict[str, Any] = {"members": members, "config": dict(self.config),
                                  "scheduler_time": self.scheduler_time}
        if self.workers:
            fields["workers"] = [[node_id, n] for node_id, n in sorted(self.workers.items())]
        return fields


@dataclasses.dataclass(frozen=True)
class LayoutCheck(Message):
    TYPE: ClassVar[str] = "layout_check"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "layout_hash": _str}
    node_id: int
    layout_hash: str


@dataclasses.dataclass(frozen=True)
class LayoutAck(Message):
    TYPE: ClassVar[str] = "layout_ack"


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "t": _float}
    node_id: int
    t: float


@dataclasses.dataclass(frozen=True)
class Leave(Message):
    """A node stopping on purpose says so before it closes its connection: the scheduler then logs a
    departure, not a failure (the survivors still get ``MemberDown`` and a policy without it)."""

    TYPE: ClassVar[str] = "leave"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "reason": _str}
    node_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class MemberDown(Message):
    """Pushed to every node when a member is declared dead (or to a node declared dead itself)."""

    TYPE: ClassVar[str] = "member_down"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "reason": _str}
    node_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class LinkBeliefs(Message):
    """Pushed to every node when policy ``version`` is published: the link rates it was planned from.

    An iteration keeps the trees of the policy it is bound to, but its senders may still choose
    auxiliary paths by what the scheduler now believes: a detour through a link that has fallen behind
    the bound policy's plan only adds to that link's backlog."""

    TYPE: ClassVar[str] = "link_beliefs"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"version": _int, "rates": _rates, "amends": _int,
                                               "offload": _moves}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"amends", "offload"})
    version: int
    rates: Mapping[tuple[int, int], float]
    """Directed link -> Mbit/s."""
    amends: int = -1
    """The older policy version ``offload`` is planned for (-1: none)."""
    offload: Mapping[tuple[int, int], tuple[tuple[tuple[int, ...], float], ...]] = dataclasses.field(
        default_factory=dict)
    """Moves for the iterations bound to ``amends``: per directed tree link of its trees, (auxiliary
    path, fraction of the link's chunks), planned for ``rates`` with that policy's shares."""

    def to_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "version": self.version,
            "rates": [[src, dst, float(r)] for (src, dst), r in sorted(self.rates.items())]}
        if self.amends >= 0:
            fields["amends"] = self.amends
            fields["offload"] = [[src, dst, list(path), float(fraction)]
                                 for (src, dst), moves in sorted(self.offload.items()) for path, fraction in moves]
        return fields


@dataclasses.dataclass(frozen=True)
class PolicyRequest(Message):
    TYPE: ClassVar[str] = "policy_request"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "iteration": _int, "known_version": _int}
    node_id: int
    iteration: int
    known_version: int
    """The newest policy version the node holds; -1 when it holds none."""


@dataclasses.dataclass(frozen=True)
class PolicyReply(Message):
    """The policy bound to ``iteration``; ``policy`` is None when the node already holds ``version``."""

    TYPE: ClassVar[str] = "policy_reply"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"iteration": _int, "version": _int, "policy": _opt_dict}
    iteration: int
    version: int
    policy: Mapping[str, Any] | None


@dataclasses.dataclass(frozen=True)
class LinkReport(Message):
    """A passive throughput measurement of the directed link src->dst (no reply)."""

    TYPE: ClassVar[str] = "link_report"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"src": _int, "dst": _int, "mbit_s": _float, "t": _float,
                                                "samples": _int, "warm": _bool}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"warm"})
    src: int
    dst: int
    mbit_s: float
    t: float
    samples: int
    warm: bool = True
    """From warm samples (the receiver's clock alone); False: cold samples only."""


@dataclasses.dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"message": _str}
    message: str


@dataclasses.dataclass(frozen=True)
class PolicyOverride(Message):
    """Admin: plan a new policy version from these rates now (tests and operators force a change)."""

    TYPE: ClassVar[str] = "policy_override"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"rates": _rates}
    rates: Mapping[tuple[int, int], float]

    def to_fields(self) -> dict[str, Any]:
        return {"rates": [[src, dst, float(r)] for (src, dst), r in sorted(self.rates.items())]}


@dataclasses.dataclass(frozen=True)
class PolicyOverrideAck(Message):
    TYPE: ClassVar[str] = "policy_override_ack"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"version": _int}
    version: int


@dataclasses.dataclass(frozen=True)
class StatusRequest(Message):
    """Admin: ask for membership and policy state (``netstorm local`` waits on it)."""

    TYPE: ClassVar[str] = "status_request"


@dataclasses.dataclass(frozen=True)
class Status(Message):
    TYPE: ClassVar[str] = "status"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"expected": _ids, "registered": _ids, "alive": _ids,
                                                "complete": _bool, "version": _int, "bindings": _pairs,
                                                "edge": _edge_modes}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"edge"})
    expected: tuple[int, ...]
    registered: tuple[int, ...]
    alive: tuple[int, ...]
    complete: bool
    """Every expected node has registered and received its RegisterAck."""
    version: int
    """The current policy version (-1 before the first plan)."""
    bindings: tuple[tuple[int, int], ...] = ()
    """(iteration, version) of the most recent bound iterations, oldest first."""
    edge: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    """Gateway node -> (how it aggregates its LAN, why XDP fell back or ""), as its ``EdgeReport`` said;
    a gateway that has not served its LAN yet is absent."""

    def to_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"expected": list(self.expected), "registered": list(self.registered),
                                  "alive": list(self.alive), "complete": self.complete, "version": self.version,
                                  "bindings": [[k, v] for k, v in self.bindings]}
        if self.edge:
            fields["edge"] = [[node_id, mode, fallback] for node_id, (mode, fallback) in sorted(self.edge.items())]
        return fields


@dataclasses.dataclass(frozen=True)
class PolicyFetch(Message):
    """Admin: the wire form of policy ``version`` (-1: the current one), answered with a PolicyReply whose
    iteration is -1. For tools that record or draw the policies a run used."""

    TYPE: ClassVar[str] = "policy_fetch"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"version": _int}
    version: int


@dataclasses.dataclass(frozen=True)
class EdgeReport(Message):
    """A gateway node says how it aggregates its LAN workers, once that is decided (no reply): the
    emulator and operators read it back from ``Status.edge`` instead of from the node's log."""

    TYPE: ClassVar[str] = "edge_report"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"node_id": _int, "mode": _str, "fallback": _str}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"fallback"})
    node_id: int
    mode: str
    """``xdp (native)``, ``xdp (generic)`` or ``userspace``."""
    fallback: str = ""
    """Why XDP could not load, when the gateway fell back to userspace ("" when it did not)."""

    def to_fields(self) -> dict[str, Any]:
        fields = super().to_fields()
        if not self.fallback:
            del fields["fallback"]
        return fields


@dataclasses.dataclass(frozen=True)
class PolicyRecord:
    """What a run's record keeps of one published policy version (not a message: a row of ``History``)."""

    version: int
    reason: str
    """Why it was planned (``first plan``, ``periodic update``, ``node down``, an override...)."""
    roots: tuple[int, ...]
    edges: tuple[tuple[int, int, int], ...]
    """(root, child, parent) of every tree edge."""

    def trees(self) -> dict[int, dict[int, int]]:
        """Root -> child -> parent."""
        out: dict[int, dict[int, int]] = {root: {} for root in self.roots}
        for root, child, parent in self.edges:
            out.setdefault(root, {})[child] = parent
        return out


@dataclasses.dataclass(frozen=True)
class HistoryRequest(Message):
    """Admin: the run's record from iteration ``since_iteration`` and version ``since_version`` on, one
    page of each (``History``); a tool that follows a run asks again from past the newest it got."""

    TYPE: ClassVar[str] = "history_request"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"since_iteration": _int, "since_version": _int}
    since_iteration: int = 0
    since_version: int = 0


@dataclasses.dataclass(frozen=True)
class History(Message):
    """The answer to a ``HistoryRequest``: a page of bindings and of published policy versions. A page
    shorter than the scheduler's page size is the last; bindings and versions older than what the
    scheduler remembers are gone (it keeps a bounded window of each)."""

    TYPE: ClassVar[str] = "history"
    FIELDS: ClassVar[Mapping[str, Checker]] = {"bindings": _pairs, "policies": _policy_records}
    bindings: tuple[tuple[int, int], ...]
    """(iteration, version) bound, by iteration."""
    policies: tuple[PolicyRecord, ...]
    """Published versions, oldest first."""

    def to_fields(self) -> dict[str, Any]:
        return {"bindings": [[k, v] for k, v in self.bindings],
                "policies": [[r.version, r.reason, list(r.roots), [list(e) for e in r.edges]]
                             for r in self.policies]}


MESSAGES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Register, RegisterAck, LayoutCheck, LayoutAck, Heartbeat, Leave, MemberDown, LinkBeliefs, PolicyRequest,
                PolicyReply, LinkReport, Error, PolicyOverride, PolicyOverrideAck, StatusRequest, Status,
                PolicyFetch, EdgeReport, HistoryRequest, History)
}


# --- codec -------------------------------------------------------------------------------------------


def encode(message: Message) -> bytes:
    """The whole frame: length prefix and msgpack body."""
    body = msgpack.packb({"v": VERSION, "type": message.TYPE, **message.to_fields()}, use_bin_type=True)
    if len(body) > MAX_CONTROL_FRAME:
        raise ControlError(f"{message.TYPE} frame of {len(body)} bytes exceeds {MAX_CONTROL_FRAME}")
    return LENGTH.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """One message from a frame body (without the length prefix)."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ControlError(f"undecodable control frame ({len(body)} bytes): {exc}") from None
    if not isinstance(data, dict):
        raise ControlError(f"control frame is not a map but {type(data).__name__}")
    version = data.get("v")
    if version != VERSION:
        raise ControlError(f"unsupported control protocol version {version!r} (this side speaks {VERSION})")
    kind = data.get("type")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ControlError(f"unknown control message type {kind!r}")
    expected = set(cls.FIELDS) | {"v", "type"}
    missing = sorted(set(cls.FIELDS) - cls.OPTIONAL - set(data))
    extra = sorted(str(k) for k in set(data) - expected)
    if missing:
        raise ControlError(f"{kind}: missing field(s) {', '.join(missing)}")
    if extra:
        raise ControlError(f"{kind}: unknown field(s) {', '.join(extra)}")
    return cls.from_fields(data)


async def read_message(reader: asyncio.StreamReader, *, max_frame: int = MAX_CONTROL_FRAME) -> Message | None:
    """The next message, or None at a clean end of stream between frames."""
    try:
        prefix = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ControlError("connection closed inside a frame length prefix") from None
    (length,) = LENGTH.unpack(prefix)
    if length > max_frame:
        raise ControlError(f"control frame of {length} bytes exceeds the limit of {max_frame}")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ControlError(f"connection closed inside a {length}-byte control frame") from None
    return decode(body)


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); the error names ``what`` (e.g. the flag)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ControlError(f"{what}: expected HOST:PORT, got {text!r}")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ControlError(f"{what}: expected HOST:PORT with a numeric port, got {text!r}") from None
    if not 0 <= port < 65536:
        raise ControlError(f"{what}: port out of range in {text!r}")
    return host, port


def format_address(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
