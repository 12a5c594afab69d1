"""Who aggregates whom on a gateway's LAN, and what the gateway tells each worker at run time.

``LanTopology`` is the two-level structure (ALEPH): ``clusters`` maps an aggregator worker's id to the ids
of the members it aggregates (itself excluded: an aggregator always contributes its own gradient to its
cluster); every other worker is unclustered and sends to the gateway directly. The gateway expects one
contribution per aggregator and per unclustered worker (``gateway_mask``); an aggregator expects its
members and itself (``cluster_mask``). An empty topology is the one-level LAN. The planner produces it;
the node receives it in its edge options (``edge_clusters``, or ``GatewayRole.deploy`` before the LAN tier
starts, or a plan the scheduler sends while it runs) and hands each worker its part in the answer to its
HELLO (``Deployment``, msgpack in the HELLO payload). A changed topology takes effect at an iteration
boundary under a new deployment epoch (netstorm/lan/redeploy.py); every worker says HELLO again for it.
"""

from __future__ import annotations

import msgspec

from netstorm.errors import ConfigError
from netstorm.lan.header import MAX_WORKERS


class LanTopology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    workers: int
    """LAN workers, ids 0..workers-1."""
    clusters: dict[int, tuple[int, ...]] = {}
    """Aggregator worker id -> the member worker ids it aggregates (itself excluded)."""

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"a LAN holds 1..{MAX_WORKERS} workers, got {self.workers}")
        seen: set[int] = set()
        for head, members in self.clusters.items():
            for w in (head, *members):
                if not 0 <= w < self.workers:
                    raise ConfigError(f"LAN topology names worker {w}; the LAN has workers 0..{self.workers - 1}")
                if w in seen:
                    raise ConfigError(f"LAN topology places worker {w} twice")
                seen.add(w)

    @classmethod
    def parse(cls, text: str, workers: int) -> LanTopology:
        """``"A:M,M;B:M"`` (aggregator A aggregates members M...; ``;`` between clusters); empty: one level."""
        clusters: dict[int, tuple[int, ...]] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            head, sep, rest = part.partition(":")
            try:
                clusters[int(head)] = tuple(int(m) for m in rest.split(",") if m.strip()) if sep else ()
            except ValueError:
                raise ConfigError(f"bad LAN cluster {part!r}: expected AGGREGATOR:MEMBER,MEMBER") from None
        return cls(workers, clusters)

    @property
    def levels(self) -> int:
        return 2 if self.clusters else 1

    @property
    def unclustered(self) -> tuple[int, ...]:
        placed = {w for head, members in self.clusters.items() for w in (head, *members)}
        return tuple(w for w in range(self.workers) if w not in placed)

    def aggregator_of(self, worker: int) -> int | None:
        """The aggregator a worker sends DATA to (None: the gateway). An aggregator's own DATA goes into
        its own cluster."""
        for head, members in self.clusters.items():
            if worker == head or worker in members:
                return head
        return None

    def gateway_mask(self) -> int:
        """The gateway's expected contributors: the aggregators and the unclustered workers."""
        return sum(1 << w for w in (*self.clusters, *self.unclustered))

    def cluster_mask(self, head: int) -> int:
        return (1 << head) | sum(1 << m for m in self.clusters[head])

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> LanTopology:
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad LAN topology: {exc}") from None


class Deployment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's part of the LAN configuration, in the gateway's answer to its HELLO."""

    pool: int
    """Slots in the pool (EdgeLayout.pool)."""
    lanes: int
    """Lanes per datagram (from the LAN MTU)."""
    scale: int
    """The fixed-point scale every tensor starts at."""
    send_to: tuple[str, int] | None = None
    """Where this worker's DATA goes: its aggregator's (address, port), or None for the gateway."""
    group: tuple[str, int] | None = None
    """The multicast group (address, port) the gateway sends ACKs and results to (None: unicast)."""
    members: tuple[int, ...] = ()
    """For an aggregator: the member ids its XDP program expects besides itself."""
    retransmit: float = 0.005
    """Seconds without progress before the worker resends its unacknowledged chunks."""
    query_nacks: bool = False
    """A late chunk is first only asked about (QUERY): the gateway NACKs exactly the workers missing from
    its slot, who resend; it is resent by everyone only if still late a timeout later."""
    first_iteration: int | None = None
    """The first iteration the gateway expects DATA for, when it knows (an aggregator installs tokens
    from there)."""
    gia_threshold: int = 0
    """A FediAC job's vote threshold the WAN roots apply (0: none): the counts then come back as the 0/1
    GIA, which a LAN worker's rounds read with a threshold of 1, as a node trainer's do."""
    pace_gbit: float | None = None
    """The Gbit/s this worker's DATA is paced to: its rate in the DC's plan (``dc_pace_rates``; None:
    unpaced, as fast as its socket takes it)."""
    epoch: int = 0
    """The deployment's epoch (netstorm/lan/redeploy.py): this worker's DATA carries it, and an aggregator
    takes only DATA that carries its own."""
    kernel_results: bool = False
    """Results come from the gateway's aggregation program itself, each chunk's as the int32 fixed-point
    aggregate (RESULT at SCALED32), and double as its ACK: the worker numbers its chunks across iterations
    and keeps at most half the pool in flight (``EdgeLayout.shadow``); a chunk whose result is late is asked
    about or resent as always, and a resend to a completed slot has the program send its result again."""
    standby: bool = False
    """For an aggregator service whose worker aggregates no cluster in this deployment: it aggregates nothing
    (and tells stale members so) until a later deployment names it."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Deployment:
        from netstorm.lan.errors import WireError

        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise WireError(f"bad deployment in the gateway's HELLO answer: {exc}") from None
