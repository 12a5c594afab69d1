"""Control-plane messages between nodes and the scheduler, and their framing.

A frame is a 4-byte little-endian body length followed by a msgpack map holding ``"v"`` (the
protocol version), ``"type"`` and the message's fields. Every message is a frozen ``msgspec.Struct``
of one tagged union (``netstorm.schema``): decoding checks every field's type and bounds in one pass
and rejects unknown types, versions and fields with a ``ControlError`` naming the message and the
field, so a confused or hostile peer gets a clear answer instead of a half-built object. A refusal is
an ``Error`` whose ``code`` (an ``ErrorCode``) tells the requester which exception to raise.

A message is added by declaring it: ``class Foo(Message, frozen=True, tag="foo")`` with annotated fields
(the bounded types of ``netstorm.schema``), relations between fields checked in ``__post_init__``, and
its class listed in ``MESSAGES``. A field added to a message that older peers already speak gets a
default, and the message ``omit_defaults=True``: it stays off the wire while it holds its default, so
those peers still decode what a newer peer sends when the feature is unused.

Replies on one connection come back in request order (the scheduler answers each request before it
reads the next), which is how the client pairs an ``Error`` with the request that caused it.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import operator
import struct
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, TypeVar

import msgspec

from netstorm import auth
from netstorm.errors import AuthError, ErrorCode, NetStormError
from netstorm.policywire import PolicyForm
from netstorm.schema import (
    DECODE_ERRORS,
    MAX_ITEMS,
    MAX_NAME,
    MAX_NODE_ID,
    MAX_NODES,
    Finite,
    Name,
    NodeId,
    NodeIds,
    Path,
    Port,
    Text,
    Version,
    envelope,
    stated,
    typed_error,
    unstated,
)

K = TypeVar("K")
V = TypeVar("V")

VERSION = 1
LENGTH = struct.Struct("<I")
MAX_CONTROL_FRAME = 64 * 1024 * 1024
"""Largest control frame body of any kind: a 200-node policy with auxiliary paths fits comfortably."""
MAX_SMALL_FRAME = 1024 * 1024
MAX_OVERRIDE_FRAME = 8 * 1024 * 1024
"""Largest admin ``PolicyOverride``: the rates of every directed link among a few hundred DCs."""
"""Largest body of a message without a long list (most kinds): its bounded fields fit far below it."""


class ControlError(NetStormError):
    """A control message is malformed or unknown, or the scheduler refused a request."""


class ControlTimeout(ControlError, TimeoutError):
    """A control-plane request did not complete in time; the message names the peer and iteration."""


class SchedulerGone(ControlError):
    """The scheduler stayed unreachable for longer than ``scheduler_grace``, or refused this node's
    re-attachment (it was declared dead meanwhile): the node cannot go on."""


class LayoutMismatch(ControlError):
    """This node's tensor layout differs from the one the first node registered."""

    code = ErrorCode.LAYOUT_MISMATCH


class ControlAuthError(ControlError, AuthError):
    """The other side of a control connection did not prove membership of the job (wrong or missing
    secret), or this connection's proven identity may not make the request."""

    code = ErrorCode.AUTH


REFUSALS: dict[ErrorCode, type[ControlError]] = {ErrorCode.LAYOUT_MISMATCH: LayoutMismatch,
                                                 ErrorCode.TIMEOUT: ControlTimeout,
                                                 ErrorCode.AUTH: ControlAuthError}
"""The exception a requester raises for the code of an Error reply; any other code raises ControlError."""


def refusal(error: Error, context: str = "") -> ControlError:
    """The exception an Error reply stands for, its message prefixed by ``context``."""
    return REFUSALS.get(error.code, ControlError)(f"{context}{error.message}")


# --- mappings that travel as rows ------------------------------------------------------------------


class RowMap(Mapping[K, V], Generic[K, V]):
    """A read-only mapping that travels as a list of rows, the form every peer has always read.

    ``ROW`` is the msgspec type of one row: decoding validates every row with it, then ``from_rows``
    checks what relates rows to each other (a node listed twice, fractions that sum above one).
    """

    ROW: ClassVar[Any]
    __slots__ = ("_items",)

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._items: dict[K, V] = dict(items) if items is not None else {}

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"

    @abc.abstractmethod
    def rows(self) -> list[Any]:
        """The wire form: one row (of type ``ROW``) per entry, sorted."""

    @classmethod
    @abc.abstractmethod
    def from_rows(cls, rows: list[Any]) -> RowMap[K, V]:
        """The mapping from rows msgspec already validated one by one; ValueError for what relates rows."""

    @classmethod
    def of(cls, value: Mapping[K, V] | list[Any]) -> Any:
        """``value`` as this class: itself when it already is one, a mapping, or the rows msgspec decoded."""
        if type(value) is cls:
            return value
        return cls.from_rows(value) if isinstance(value, list) else cls(value)


def _once(node_id: int, seen: Mapping[int, object]) -> int:
    if node_id in seen:
        raise ValueError(f"node {node_id} listed twice")
    return node_id


class Members(RowMap[int, tuple[str, int]]):
    """Member -> (data host, data port); rows [id, host, port] sorted by id."""

    ROW = tuple[NodeId, Name, Port]

    def rows(self) -> list[Any]:
        return [[node_id, host, port] for node_id, (host, port) in sorted(self._items.items())]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> Members:
        out: dict[int, tuple[str, int]] = {}
        for node_id, host, port in rows:
            out[_once(node_id, out)] = (host, port)
        return cls(out)


class WorkerCounts(RowMap[int, int]):
    """Member -> workers its contribution sums; rows [id, workers] sorted by id."""

    ROW = tuple[NodeId, int]

    def rows(self) -> list[Any]:
        return [[node_id, n] for node_id, n in sorted(self._items.items())]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> WorkerCounts:
        out: dict[int, int] = {}
        for node_id, n in rows:
            out[_once(node_id, out)] = n
        return cls(out)


class Rates(RowMap[tuple[int, int], float]):
    """Directed link -> Mbit/s; rows [src, dst, mbit_s] sorted by link, every rate positive."""

    ROW = tuple[NodeId, NodeId, Finite]

    def rows(self) -> list[Any]:
        return [[src, dst, float(r)] for (src, dst), r in sorted(self._items.items())]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> Rates:
        out: dict[tuple[int, int], float] = {}
        for src, dst, rate in rows:
            if not rate > 0:
                raise ValueError(f"rate of {src}->{dst} must be positive, got {rate}")
            out[(src, dst)] = rate
        return cls(out)


Move = tuple[tuple[int, ...], float]


class Moves(RowMap[tuple[int, int], tuple[Move, ...]]):
    """Planned offload: directed tree link -> (simple detour from src to dst, share of the link's chunks
    it carries), at most 1 in all per link; rows [src, dst, path, fraction]."""

    ROW = tuple[NodeId, NodeId, Path, Finite]

    def rows(self) -> list[Any]:
        return [[src, dst, list(path), float(fraction)]
                for (src, dst), moves in sorted(self._items.items()) for path, fraction in moves]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> Moves:
        out: dict[tuple[int, int], list[Move]] = {}
        for src, dst, hops, share in rows:
            if len(hops) < 3:
                raise ValueError(f"path of {src}->{dst} must list at least three nodes, got {list(hops)}")
            if hops[0] != src or hops[-1] != dst or len(set(hops)) != len(hops):
                raise ValueError(f"{list(hops)} is not a simple detour from {src} to {dst}")
            if not 0 < share <= 1:
                raise ValueError(f"fraction of {list(hops)} must be in (0, 1], got {share}")
            out.setdefault((src, dst), []).append((hops, share))
        for (src, dst), paths in out.items():
            if sum(share for _, share in paths) > 1 + 1e-9:
                raise ValueError(f"fractions of {src}->{dst} sum above 1")
        return cls({link: tuple(paths) for link, paths in out.items()})


class EdgeModes(RowMap[int, tuple[str, str]]):
    """Gateway node -> (how it aggregates its LAN, why XDP fell back or ""); rows [id, mode, fallback]."""

    ROW = tuple[NodeId, Name, Text]

    def rows(self) -> list[Any]:
        return [[node_id, mode, fallback] for node_id, (mode, fallback) in sorted(self._items.items())]

    @classmethod
    def from_rows(cls, rows: list[Any]) -> EdgeModes:
        out: dict[int, tuple[str, str]] = {}
        for node_id, mode, fallback in rows:
            out[_once(node_id, out)] = (mode, fallback)
        return cls(out)


_ROWS: dict[type[RowMap[Any, Any]], Any] = {
    cls: Annotated[list[cls.ROW], msgspec.Meta(max_length=most)]  # type: ignore[name-defined]
    for cls, most in ((Members, MAX_NODES), (WorkerCounts, MAX_NODES), (Rates, MAX_ITEMS), (Moves, MAX_ITEMS),
                      (EdgeModes, MAX_NODES))}
"""The msgspec type of each row mapping's rows, bounded."""
_NO_WORKERS = WorkerCounts()
_NO_MEMBERS = Members()
_NO_MOVES = Moves()
_NO_EDGE = EdgeModes()
"""Shared empty defaults: a field holding one of these is at its default, so it stays off the wire."""

if TYPE_CHECKING:  # to a type checker any mapping will do; msgspec reads (and writes) the row form
    MembersField = Mapping[int, tuple[str, int]]
    WorkersField = Mapping[int, int]
    RatesField = Mapping[tuple[int, int], float]
    MovesField = Mapping[tuple[int, int], tuple[Move, ...]]
    EdgeModesField = Mapping[int, tuple[str, str]]
    PolicyField = dict[str, Any]
else:  # msgspec decodes the bounded rows, typed, and ``__post_init__`` makes them the mapping
    MembersField, WorkersField, RatesField, MovesField, EdgeModesField = (
        _ROWS[Members], _ROWS[WorkerCounts], _ROWS[Rates], _ROWS[Moves], _ROWS[EdgeModes])
    PolicyField = PolicyForm


def _enc_hook(value: Any) -> Any:
    if isinstance(value, RowMap):
        return value.rows()
    if isinstance(value, int):  # an Unstated version
        return int(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _force(message: msgspec.Struct, name: str, value: object) -> None:
    msgspec.structs.force_setattr(message, name, value)


def _workers(where: str, count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ControlError(f"{where}: a DC contributes at least its own trainer (1 worker), got {count}")
    return count


# --- messages ------------------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every control message: ``v`` is written by the encoder and checked at decode; ``TYPE`` is
    the message's tag on the wire."""

    TYPE: ClassVar[str] = ""
    MAX_BYTES: ClassVar[int] = MAX_SMALL_FRAME
    """Largest body of this kind: a receiver reads at most the largest bound of the kinds it accepts."""
    v: int = msgspec.field(default_factory=unstated(VERSION))

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise ControlError(f"unsupported control protocol version {self.v!r} (this side speaks {VERSION})")


class Register(Message, frozen=True, tag="register", omit_defaults=True):
    node_id: NodeId
    data_host: Name
    data_port: Port
    workers: int = 1
    """Workers whose gradients this DC's contribution sums: its own trainer and the LAN workers its
    gateway aggregates (``netstorm node --edge-workers``)."""
    probe_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the bulk-probe sink the node keeps on its data host until its RegisterAck (0: none): where
    the scheduler has peers measure their links to it before the first policy (``ProbeRequest``)."""
    attach: bool = False
    """The node has run in this job without a break and re-attaches after losing the scheduler (a
    restarted scheduler, a broken connection); False: a new process, admitted at an iteration boundary."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _workers(f"{self.TYPE}.workers", self.workers)


PROBE_MAX_BYTES = 1 << 34
"""Largest bulk probe a ``ProbeRequest`` asks for (``netstorm.bulkprobe``'s sink limit)."""


class ProbeRequest(Message, frozen=True, tag="probe_request"):
    """Sent before the ``RegisterAck`` when the scenario states no rate for some links: measure each
    target's link with a bulk probe of ``nbytes``, one after the other, heartbeating every
    ``heartbeat_s`` meanwhile, and answer with one ``ProbeResult``."""

    targets: Annotated[tuple[tuple[NodeId, Name, Port], ...], msgspec.Meta(max_length=MAX_NODES)]
    """(peer, its data host, its probe sink's port) of each outgoing link to measure."""
    nbytes: Annotated[int, msgspec.Meta(ge=2, le=PROBE_MAX_BYTES)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    """Seconds one link's probe may take."""
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]


class ProbeResult(Message, frozen=True, tag="probe_result"):
    """A node's answer to ``ProbeRequest``: per target the measured Mbit/s, or -1 and why it failed."""

    node_id: NodeId
    rows: Annotated[tuple[tuple[NodeId, Finite, Text], ...], msgspec.Meta(max_length=MAX_NODES)]


class RegisterAck(Message, frozen=True, tag="register_ack", omit_defaults=True):
    """Sent to every node once all expected nodes have registered."""

    MAX_BYTES = MAX_CONTROL_FRAME

    members: MembersField
    config: Annotated[dict[Name, bool | int | float | Text | None], msgspec.Meta(max_length=MAX_NAME)]
    """The scheduler's options (every value a scalar)."""
    scheduler_time: Finite
    workers: WorkersField = _NO_WORKERS
    """Member -> workers its contribution sums (Register.workers). Kept, and sent, only where it is not
    1, so an ack naming every member with 1 equals one naming none; ``workers_of`` reads it."""
    running: bool = False
    """The job was running when this node registered: it is admitted at its trainer's layout check, and
    its peers may send it chunks of its boundary iteration before it knows which iteration that is."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _force(self, "members", Members.of(self.members))
        _force(self, "workers", WorkerCounts.of(self.workers))
        strangers = sorted(set(self.workers) - set(self.members))
        if strangers:
            raise ControlError(f"{self.TYPE}.workers: node(s) {strangers} are not members")
        counts = {n: _workers(f"{self.TYPE}.workers[{n}]", w) for n, w in sorted(self.workers.items()) if w != 1}
        _force(self, "workers", WorkerCounts(counts) if counts else _NO_WORKERS)

    def workers_of(self, node_id: int) -> int:
        return self.workers.get(node_id, 1)


class LayoutCheck(Message, frozen=True, tag="layout_check"):
    node_id: NodeId
    layout_hash: Name


class LayoutAck(Message, frozen=True, tag="layout_ack", omit_defaults=True):
    first_iteration: Version = 0
    """The iteration this node's first contribution belongs to: 0 for a node there from the start; for a
    DC admitted into a running job, the boundary iteration that hands it the live model."""
    pending: bool = False
    """The job's layout is not decided yet (fewer than a majority of its DCs agree on one): ask again."""


IterationTimes = Annotated[tuple[tuple[Version, Annotated[float, msgspec.Meta(ge=0, le=1e9)]], ...],
                          msgspec.Meta(max_length=MAX_NODES)]
"""(iteration, seconds from its start at the node to its result there)."""


class Heartbeat(Message, frozen=True, tag="heartbeat", omit_defaults=True):
    node_id: NodeId
    t: Finite
    done: IterationTimes = ()
    """Iterations the node completed since its last heartbeat, with their times there (for operators:
    the scheduler sets them against their min-cut limit)."""
    model_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**53)] = 0
    """Bytes of the registered model (0 before registration): the M of the limit M / λ."""


class Leave(Message, frozen=True, tag="leave"):
    """A node stopping on purpose says so before it closes its connection: the scheduler then logs a
    departure, not a failure (the survivors still get ``MemberDown`` and a policy without it)."""

    node_id: NodeId
    reason: Text


class MemberDown(Message, frozen=True, tag="member_down"):
    """Pushed to every node when a member is declared dead (or to a node declared dead itself)."""

    node_id: NodeId
    reason: Text


class IterationLost(Message, frozen=True, tag="iteration_lost"):
    """Node ``node_id``'s part of ``iteration`` will not come (its trainer closed or died before pushing
    it): the node tells the scheduler, which tells every other member, so the iteration fails everywhere
    at once (``PeerLost``) instead of at its timeout. The node itself stays a member."""

    node_id: NodeId
    iteration: Version
    reason: Text


class Vacancy(Message, frozen=True, tag="vacancy", omit_defaults=True):
    """Node ``node_id``'s trainer place is empty after the init round (its trainer closed or died, and no
    replacement inited yet): its part of every iteration from ``iteration`` on will not come. The node tells
    the scheduler, which tells every other member; a member that has an iteration from ``iteration`` on under
    way asks the node for its part (``PartWanted``), and the node fails the iteration everywhere
    (``IterationLost``). ``filled``: a replacement inited, the node's part comes again from ``iteration`` on."""

    node_id: NodeId
    iteration: Version
    reason: Text = ""
    filled: bool = False


class PartWanted(Message, frozen=True, tag="part_wanted"):
    """Node ``node_id`` has ``iteration`` under way, which needs node ``peer``'s part, and ``peer`` said its
    trainer place is empty (``Vacancy``): the scheduler forwards this to ``peer`` alone, which fails the
    iteration at every member (``IterationLost``) unless a replacement filled its place meanwhile. A DC that
    no chunk reaches before its own part is in (a leaf of every tree) learns so that its iteration is under way."""

    node_id: NodeId
    peer: NodeId
    iteration: Version


class PeerUnreachable(Message, frozen=True, tag="peer_unreachable"):
    """A node lost (or could not open) its data connection to ``peer`` and is reconnecting. Evidence
    for the scheduler, not a verdict: only the scheduler declares a member dead, from its own
    heartbeats and connections, and then tells everyone with ``MemberDown``."""

    node_id: NodeId
    peer: NodeId
    reason: Text


class MemberUp(Message, frozen=True, tag="member_up", omit_defaults=True):
    """Pushed to every member when a DC registers into a running job (a restarted or a new DC): peers
    accept its connections from now on; it joins the policies at the boundary its ``LayoutAck`` names."""

    node_id: NodeId
    data_host: Name
    data_port: Port
    workers: int = 1
    joins_at: Version = -1
    """Sent again once it is admitted: its boundary iteration, whose chunks it may send before the
    receiver's own contributions reach the iteration before (-1: not admitted yet)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _workers(f"{self.TYPE}.workers", self.workers)


class LinkBeliefs(Message, frozen=True, tag="link_beliefs", omit_defaults=True):
    """Pushed to every node when policy ``version`` is published: the link rates it was planned from.

    An iteration keeps the trees of the policy it is bound to, but its senders may still choose
    auxiliary paths by what the scheduler now believes: a detour through a link that has fallen behind
    the bound policy's plan only adds to that link's backlog."""

    MAX_BYTES = MAX_CONTROL_FRAME

    version: Version
    rates: RatesField
    """Directed link -> Mbit/s."""
    amends: Version = -1
    """The older policy version ``offload`` is planned for (-1: none)."""
    offload: MovesField = _NO_MOVES
    """Moves for the iterations bound to ``amends``: per directed tree link of its trees, (auxiliary
    path, fraction of the link's chunks), planned for ``rates`` with that policy's shares. Sent only with
    ``amends``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _force(self, "rates", Rates.of(self.rates))
        _force(self, "offload", Moves.of(self.offload) if self.amends >= 0 and self.offload else _NO_MOVES)


class PolicyRequest(Message, frozen=True, tag="policy_request"):
    node_id: NodeId
    iteration: Version
    known_version: Version
    """The newest policy version the node holds; -1 when it holds none."""


class PolicyReply(Message, frozen=True, tag="policy_reply", omit_defaults=True):
    """The policy bound to ``iteration``; ``policy`` (``Policy.to_wire``'s form) is None when the node
    already holds ``version``."""

    MAX_BYTES = MAX_CONTROL_FRAME

    iteration: Version
    version: Version
    policy: PolicyField | None
    joining: NodeIds = ()
    """DCs admitted at this iteration: it hands them the live model (one live DC contributes its
    trainer's model, everyone else zeros) instead of summing gradients."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.policy, PolicyForm):  # decoded typed; its readers take the builtin form
            _force(self, "policy", msgspec.to_builtins(self.policy))


class LinkReport(Message, frozen=True, tag="link_report"):
    """A passive throughput measurement of the directed link src->dst: what ``netstorm.probe`` makes
    and a node sends as it is (no reply)."""

    src: NodeId
    dst: NodeId
    mbit_s: Finite
    t: Finite
    samples: Annotated[int, msgspec.Meta(ge=0, le=2**53)]
    warm: bool = True
    """From warm samples (the receiver's clock alone); False: cold samples only."""


class Error(Message, frozen=True, tag="error"):
    """A refusal: ``code`` tells the requester's program why, ``message`` tells people."""

    message: Text
    code: ErrorCode = ErrorCode.PROTOCOL


class PolicyOverride(Message, frozen=True, tag="policy_override"):
    """Admin: plan a new policy version from these rates now (tests and operators force a change)."""

    MAX_BYTES = MAX_OVERRIDE_FRAME

    rates: RatesField

    def __post_init__(self) -> None:
        super().__post_init__()
        _force(self, "rates", Rates.of(self.rates))


class PolicyOverrideAck(Message, frozen=True, tag="policy_override_ack"):
    version: Version


class StatusRequest(Message, frozen=True, tag="status_request"):
    """Admin: ask for membership and policy state (``netstorm local`` waits on it)."""


class Status(Message, frozen=True, tag="status", omit_defaults=True):
    MAX_BYTES = MAX_CONTROL_FRAME
    expected: NodeIds
    registered: NodeIds
    alive: NodeIds
    complete: bool
    """Every expected node has registered and received its RegisterAck."""
    version: Version
    """The current policy version (-1 before the first plan)."""
    bindings: Annotated[tuple[tuple[Version, Version], ...], msgspec.Meta(max_length=MAX_NODES)] = ()
    """(iteration, version) of the most recent bound iterations, oldest first."""
    edge: EdgeModesField = _NO_EDGE
    """Gateway node -> (how it aggregates its LAN, why XDP fell back or ""), as its ``EdgeReport`` said;
    a gateway that has not served its LAN yet is absent."""
    addresses: MembersField = _NO_MEMBERS
    """Registered live node -> the data-plane address it registered."""
    states: Annotated[tuple[tuple[NodeId, Name, Text], ...], msgspec.Meta(max_length=MAX_NODES)] = ()
    """(node, state, why) of every expected node: state ``expected`` (not registered yet), ``registered``
    (waiting for the others), ``alive`` or ``down`` (why: the reason it was declared gone)."""
    links: Annotated[tuple[tuple[NodeId, NodeId, Finite, Finite, Finite], ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    """(src, dst, believed Mbit/s, newest reported Mbit/s or -1, seconds since that report or -1) of every
    directed link the scheduler plans with."""
    iterations: Annotated[tuple[tuple[Version, Version, Finite, Finite], ...], msgspec.Meta(max_length=MAX_NODES)] = ()
    """(iteration, policy version, seconds its slowest DC took, its min-cut limit in seconds or -1) of the
    newest iterations nodes reported complete, oldest first."""
    lan: Annotated[tuple[tuple[NodeId, Name, Version, Name, Finite], ...], msgspec.Meta(max_length=MAX_NODES)] = ()
    """(DC, LAN aggregation mode or "", LAN plan version or -1, its planner or "", its predicted Gbit/s or
    0) of every DC with a LAN tier the scheduler knows of."""
    probed: Annotated[tuple[tuple[NodeId, NodeId, Finite, Text], ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    """(src, dst, Mbit/s or -1, why not or "") of every link with no stated rate, once the first probe
    round has ended: what it measured, so a run or an operator can set it against the truth (the first
    policy was planned from it, the prior where it is -1); empty without a round."""
    probe_s: Finite = -1.0
    """Seconds the first probe round took (-1: none ran, or it has not ended)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _force(self, "edge", EdgeModes.of(self.edge) if self.edge else _NO_EDGE)
        _force(self, "addresses", Members.of(self.addresses) if self.addresses else _NO_MEMBERS)


class PolicyFetch(Message, frozen=True, tag="policy_fetch"):
    """Admin: the wire form of policy ``version`` (-1: the current one), answered with a PolicyReply whose
    iteration is -1. For tools that record or draw the policies a run used."""

    version: Version


class EdgeReport(Message, frozen=True, tag="edge_report", omit_defaults=True):
    """A gateway node says how it aggregates its LAN workers, once that is decided (no reply): the
    emulator and operators read it back from ``Status.edge`` instead of from the node's log."""

    node_id: NodeId
    mode: Name
    """``xdp (native)``, ``xdp (generic)`` or ``userspace``."""
    fallback: Text = ""
    """Why XDP could not load, when the gateway fell back to userspace ("" when it did not)."""


class PolicyRecord(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a run's record keeps of one published policy version (not a message: a row of ``History``,
    on the wire [version, reason, roots, edges])."""

    version: Version
    reason: Text
    """Why it was planned (``first plan``, ``periodic update``, ``node down``, an override...)."""
    roots: NodeIds
    edges: Annotated[tuple[tuple[NodeId, NodeId, NodeId], ...], msgspec.Meta(max_length=MAX_ITEMS)]
    """(root, child, parent) of every tree edge."""

    def trees(self) -> dict[int, dict[int, int]]:
        """Root -> child -> parent."""
        out: dict[int, dict[int, int]] = {root: {} for root in self.roots}
        for root, child, parent in self.edges:
            out.setdefault(root, {})[child] = parent
        return out


class HistoryRequest(Message, frozen=True, tag="history_request"):
    """Admin: the run's record from iteration ``since_iteration`` and version ``since_version`` on, one
    page of each (``History``); a tool that follows a run asks again from past the newest it got."""

    since_iteration: Version
    since_version: Version


class History(Message, frozen=True, tag="history"):
    """The answer to a ``HistoryRequest``: a page of bindings and of published policy versions. A page
    shorter than the scheduler's page size is the last; bindings and versions older than what the
    scheduler remembers are gone (it keeps a bounded window of each)."""

    MAX_BYTES = MAX_CONTROL_FRAME

    bindings: Annotated[tuple[tuple[Version, Version], ...], msgspec.Meta(max_length=MAX_ITEMS)]
    """(iteration, version) bound, by iteration."""
    policies: Annotated[tuple[PolicyRecord, ...], msgspec.Meta(max_length=MAX_NODES)]
    """Published versions, oldest first."""


# --- the tier inside a DC -----------------------------------------------------------------------------

Gbit = Annotated[float, msgspec.Meta(gt=0, le=1e6)]
"""A LAN rate in Gbit/s: positive and finite."""
Precision = Annotated[str, msgspec.Meta(pattern="^(fp32|fp16|bf16|int8)$")]
MAX_LAN_WORKERS = 1024


class LanWorkerRow(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One LAN worker as a ``LanReport`` row: [index, up, down, compute_s, precision, rack, agg_gbit]."""

    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAN_WORKERS)]
    up_gbit: Gbit
    down_gbit: Gbit
    compute_s: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0
    precision: Precision = "fp32"
    rack: Annotated[int, msgspec.Meta(ge=-1, le=MAX_NODE_ID)] = -1
    """-1: in no rack."""
    agg_gbit: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 0.0
    """0: bounded by its ports alone."""


class LanRackRow(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """[id, aggregator_gbit, uplink_gbit, [[precision, gbit], ...]]."""

    id: NodeId
    aggregator_gbit: Gbit
    uplink_gbit: Gbit
    precision_gbit: Annotated[tuple[tuple[Precision, Annotated[float, msgspec.Meta(ge=0, le=1e6)]], ...],
                              msgspec.Meta(max_length=4)] = ()


class LanReport(Message, frozen=True, tag="lan_report", omit_defaults=True):
    """A gateway describes its LAN to the scheduler (no reply): first as configured, then with each
    worker's rates as measured passively (``measured``). The scheduler plans the DC's tier from it with
    ``dc_planner`` and answers, when the plan changes, with a ``LanPlan``."""

    node_id: NodeId
    gateway_gbit: Gbit
    workers: Annotated[tuple[LanWorkerRow, ...], msgspec.Meta(min_length=1, max_length=MAX_LAN_WORKERS)]
    racks: Annotated[tuple[LanRackRow, ...], msgspec.Meta(max_length=MAX_LAN_WORKERS)] = ()
    measured: bool = False
    t: Finite = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        indices = [w.index for w in self.workers]
        if sorted(indices) != list(range(len(indices))):
            raise ValueError(f"workers must be indexed 0..{len(indices) - 1} once each, got {indices}")
        racks = {r.id for r in self.racks}
        if len(racks) != len(self.racks):
            raise ValueError("a rack is listed twice")
        for w in self.workers:
            if w.rack >= 0 and w.rack not in racks:
                raise ValueError(f"worker {w.index} sits in unknown rack {w.rack}")


class LanPlan(Message, frozen=True, tag="lan_plan", omit_defaults=True):
    """Pushed to a gateway node: how its LAN tier aggregates, in the data plane's two-level form.

    ``clusters`` maps an aggregator worker to its members; every worker not a member (aggregators
    included) sends to the gateway; ``rates`` are the Gbit/s the plan allocates each worker, which it paces
    its DATA to with ``dc_pace_rates`` (told in its HELLO answer). ``version``
    grows with every plan of this DC, so a late plan never replaces a newer one."""

    node_id: NodeId
    version: Version
    planner: Name
    clusters: Annotated[tuple[tuple[NodeId, tuple[NodeId, ...]], ...], msgspec.Meta(max_length=MAX_LAN_WORKERS)]
    direct: Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_LAN_WORKERS)]
    rates: Annotated[tuple[tuple[NodeId, Gbit], ...], msgspec.Meta(max_length=MAX_LAN_WORKERS)]
    predicted_gbit: Finite = 0.0
    notes: Text = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        seen: set[int] = set(self.direct)
        if len(seen) != len(self.direct):
            raise ValueError("a worker is listed twice in direct")
        for agg, members in self.clusters:
            if agg not in seen:
                raise ValueError(f"aggregator {agg} must send to the gateway (list it in direct)")
            for m in members:
                if m in seen or m == agg:
                    raise ValueError(f"worker {m} is placed twice")
                seen.add(m)

    def two_level(self) -> tuple[dict[int, list[int]], list[int]]:
        """``{aggregator: [members]}`` and the workers sending to the gateway (the data plane's form)."""
        return {a: list(m) for a, m in self.clusters}, list(self.direct)


MESSAGES: dict[str, type[Message]] = {}
for _cls in (Register, RegisterAck, LayoutCheck, LayoutAck, Heartbeat, Leave, MemberDown, IterationLost,
             Vacancy, PartWanted, PeerUnreachable, MemberUp,
             LinkBeliefs, PolicyRequest, PolicyReply, LinkReport, Error, PolicyOverride, PolicyOverrideAck,
             StatusRequest, Status, PolicyFetch, EdgeReport, HistoryRequest, History, LanReport, LanPlan,
             ProbeRequest, ProbeResult):
    _cls.TYPE = str(_cls.__struct_config__.tag)
    MESSAGES[_cls.TYPE] = _cls

_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


class Inbound:
    """What one receiver accepts: its kinds, decoded with their schema and nothing else, and the largest
    frame it reads (the largest ``MAX_BYTES`` of those kinds), so a frame is bounded by its kind before
    its body is read and after it is decoded."""

    def __init__(self, who: str, kinds: tuple[type[Message], ...]) -> None:
        self.who = who
        self.kinds = {kind.TYPE: kind for kind in kinds}
        self.max_frame = max(kind.MAX_BYTES for kind in kinds)
        self._decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(
            functools.reduce(operator.or_, kinds))

    def decode(self, body: bytes | bytearray | memoryview) -> Message:
        """One message from a frame body (without the length prefix)."""
        try:
            message = self._decoder.decode(body)
        except DECODE_ERRORS as exc:
            raise self._diagnose(body, exc) from None
        if not stated(message.v):
            raise ControlError(f"unsupported control protocol version None (this side speaks {VERSION})")
        if len(body) > message.MAX_BYTES:
            raise ControlError(f"{message.TYPE} frame of {len(body)} bytes exceeds its kind's limit of "
                               f"{message.MAX_BYTES}")
        return message

    def _diagnose(self, body: bytes | bytearray | memoryview, exc: Exception) -> ControlError:
        """Why a frame did not decode, in the words of its envelope (map, version, type) before its
        fields'; only the envelope is decoded again, never the frame as untyped msgpack."""
        try:
            version, kind = envelope(body)
        except msgspec.ValidationError as not_map:
            return ControlError(f"control frame ({len(body)} bytes) is not a map: {not_map}")
        except DECODE_ERRORS as undecodable:
            return ControlError(f"undecodable control frame ({len(body)} bytes): "
                                f"{typed_error(ControlError, 'frame', undecodable)}")
        if version != VERSION or isinstance(version, bool):
            return ControlError(f"unsupported control protocol version {version!r} (this side speaks {VERSION})")
        if not isinstance(kind, str) or kind not in MESSAGES:
            return ControlError(f"unknown control message type {kind!r}")
        if kind not in self.kinds:
            return ControlError(f"{self.who} does not accept {kind} messages")
        return typed_error(ControlError, kind, exc)


ANY = Inbound("this side", tuple(MESSAGES.values()))
"""Every kind (what tools and tests decode)."""
TO_SCHEDULER = Inbound("the scheduler", (Register, LayoutCheck, Heartbeat, Leave, IterationLost, PeerUnreachable,
                                         Vacancy, PartWanted, PolicyRequest,
                                         LinkReport, EdgeReport, LanReport, PolicyOverride, StatusRequest,
                                         PolicyFetch, HistoryRequest, ProbeResult))
"""What nodes and admin tools send the scheduler: none of it is larger than an override's rates."""


# --- codec -------------------------------------------------------------------------------------------


def encode(message: Message) -> bytes:
    """The whole frame: length prefix and msgpack body."""
    body = _ENCODER.encode(message)
    if len(body) > message.MAX_BYTES:
        raise ControlError(f"{message.TYPE} frame of {len(body)} bytes exceeds its kind's limit of "
                           f"{message.MAX_BYTES}")
    return LENGTH.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview, inbound: Inbound = ANY) -> Message:
    """One message from a frame body (without the length prefix), of a kind ``inbound`` accepts."""
    return inbound.decode(body)


async def read_message(reader: asyncio.StreamReader, *, inbound: Inbound = ANY,
                       max_frame: int | None = None) -> Message | None:
    """The next message, or None at a clean end of stream between frames. A frame longer than
    ``inbound`` accepts (or ``max_frame``) is refused from its length prefix, before it is read."""
    limit = inbound.max_frame if max_frame is None else min(max_frame, inbound.max_frame)
    try:
        prefix = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ControlError("connection closed inside a frame length prefix") from None
    if prefix == auth.MAGIC:
        raise ControlAuthError("authentication failed: the peer authenticates with a job secret, this side "
                               "has none (secret_file)")
    (length,) = LENGTH.unpack(prefix)
    if length > limit:
        raise ControlError(f"control frame of {length} bytes exceeds the limit of {limit} ({inbound.who} reads "
                           f"no kind larger)")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ControlError(f"connection closed inside a {length}-byte control frame") from None
    return inbound.decode(body)


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
