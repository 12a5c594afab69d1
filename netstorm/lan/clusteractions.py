"""What a cluster aggregator's core (netstorm/lan/clustercore.py) asks its shell (bpf/cluster.py) to do: send a
datagram, drive the aggregation program through its maps, read slots, or give up."""

from __future__ import annotations

from dataclasses import dataclass

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Send:
    """One control datagram (HELLO to the gateway, MOVED or NACK to a member) for ``to``."""

    datagram: bytes
    to: Address


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Run the DATA datagram just handed in through the program; what it completes goes on to the gateway."""


AGGREGATE = Aggregate()
TAKE = (AGGREGATE,)
"""The answer to current DATA: allocated once, since every member's DATA in userspace mode asks."""


@dataclass(frozen=True, slots=True)
class Configure:
    """The contributors the program expects and the deployment epoch DATA must carry, rewritten in place."""

    expected: int
    epoch: int


@dataclass(frozen=True, slots=True)
class RequireTokens:
    """Check DATA's tokens from now on; the forwarded aggregates carry ``agg_token``."""

    agg_token: int


@dataclass(frozen=True, slots=True)
class InstallTokens:
    """(worker, iteration, token) into the program's token map, this worker's own among them."""

    entries: list[tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class Bound:
    """Sum DATA of no iteration newer than ``horizon`` (None: of any); newer DATA is refused and counted."""

    horizon: int | None


@dataclass(frozen=True, slots=True)
class Ask:
    """A gateway's NACK for chunk ``seq`` (``iteration``, ``tensor``, ``chunk``) held in ``slot`` here, due for a
    look at ``due``."""

    slot: int
    iteration: int
    tensor: int
    chunk: int
    seq: int
    due: float


@dataclass(frozen=True, slots=True)
class ReadSlots:
    """Read these asks' slots (``slot_states``) and hand the rows back (``ClusterCore.slots``)."""

    asks: tuple[Ask, ...]


@dataclass(frozen=True, slots=True)
class Fail:
    """The service cannot go on (a deployment the loaded program cannot take): stop, raising ``error``."""

    error: Exception


Action = Send | Aggregate | Configure | RequireTokens | InstallTokens | Bound | ReadSlots | Fail
