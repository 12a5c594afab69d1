"""The sender's communication scheduler (paper Fig. 7): primary path first, auxiliary paths when it lags.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence

Path = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LinkView:
    """What a sender knows about its link to one neighbour right now."""

    backlog_bytes: int
    """Bytes waiting to be sent on the link (queued by the node and unsent in the kernel)."""
    rate_bps: float | None
    """Bytes per second the link sent at while backlogged, recently; None before it has a measurement."""


class PathScheduler:
    """Chooses the path of each chunk on one tree edge and counts chunks in flight per path."""

    def __init__(self, primary: Path, aux: Sequence[Path], *, busy_bound: int, aux_queue_length: int,
                 enabled: bool, planned_bps: Mapping[tuple[int, int], float] | None = None,
                 slowdown: float = 0.0, reroute_below: float = 0.0,
                 offload: Sequence[tuple[Path, float]] = ()) -> None:
        primary = tuple(primary)
        if len(primary) < 2 or len(set(primary)) != len(primary):
            raise ValueError(f"primary path {primary} must join two distinct nodes without repeats")
        if busy_bound < 0 or aux_queue_length < 0:
            raise ValueError(f"busy_bound ({busy_bound}) and aux_queue_length ({aux_queue_length}) "
                             f"must be >= 0")
        if not 0 <= slowdown < 1:
            raise ValueError(f"slowdown must be in [0, 1), got {slowdown}")
        if not 0 <= reroute_below <= 1:
            raise ValueError(f"reroute_below must be in [0, 1], got {reroute_below}")
        aux_paths: list[Path] = []
        for path in aux:
            path = tuple(path)
            if path[:1] != primary[:1] or path[-1:] != primary[-1:] or len(set(path)) != len(path):
                raise ValueError(f"auxiliary path {path} must run from {primary[0]} to {primary[-1]} "
                                 f"without repeats")
            if path != primary and path not in aux_paths:
                aux_paths.append(path)
        self.primary = primary
        self.aux: tuple[Path, ...] = tuple(aux_paths)
        self.busy_bound = busy_bound
        self.aux_queue_length = aux_queue_length
        self.enabled = enabled
        self.planned_bps = dict(planned_bps or {})
        """Directed link -> the rate (bytes/s) the policy was planned with."""
        self.slowdown = slowdown
        self.reroute_below = reroute_below
        """Queued chunks move (``reroute``) only while the primary sends below this fraction of its plan."""
        self.offload: tuple[tuple[Path, float], ...] = tuple((tuple(p), float(f)) for p, f in offload)
        """Planned (path, fraction of this edge's chunks) detours."""
        _check_offload(primary, self.offload)
        # Half a chunk of credit to start: the first detour goes as soon as its fraction rounds to one.
        self._credit: dict[Path, float] = {path: 0.5 for path, _ in self.offload}
        self._in_flight: dict[Path, int] = {primary: 0, **{p: 0 for p in self.aux},
                                            **{p: 0 for p, _ in self.offload}}
        self.believed_bps: dict[tuple[int, int], float] = {}
        """Directed link -> the rate (bytes/s) a newer policy was planned from (``believe``)."""
        self._blocked: frozenset[Path] = frozenset()

    def believe(self, rates_bps: Mapping[tuple[int, int], float]) -> None:
        """The rates a newer policy was planned from: paths whose later hops fell behind this policy's
        plan are left out from now on."""
        self.believed_bps = dict(rates_bps)
        if self.slowdown == 0:
            return
        self._blocked = frozenset(path for path in (*self.aux, *(p for p, _ in self.offload))
                                  if any(self._behind(hop) for hop in itertools.pairwise(path[1:])))

    def amend(self, offload: Sequence[tuple[Path, float]]) -> None:
        """Replace the planned offload by one re-planned for newer rates (with this policy's trees and
        shares); its paths are used whatever ``believe`` says of their hops, since the re-plan weighed them."""
        moves = tuple((tuple(p), float(f)) for p, f in offload)
        _check_offload(self.primary, moves)
        self.offload = moves
        self._credit = {path: 0.5 for path, _ in moves}
        for path, _ in moves:
            self._in_flight.setdefault(path, 0)
        self._blocked = self._blocked - {path for path, _ in moves}

    def take(self, path: Path) -> None:
        """A chunk counted on the primary moves to ``path`` (one of this scheduler's) before it left."""
        path = tuple(path)
        if path not in self._in_flight or path == self.primary:
            raise ValueError(f"path {path} is not one of this scheduler's detours")
        if self._in_flight[self.primary] == 0:
            raise ValueError(f"the primary {self.primary} has no chunk in flight to move")
        self._in_flight[self.primary] -= 1
        self._in_flight[path] += 1

    def _behind(self, hop: tuple[int, int]) -> bool:
        believed, planned = self.believed_bps.get(hop), self.planned_bps.get(hop)
        return believed is not None and planned is not None and believed < planned * (1 - self.slowdown)

    @property
    def blocked(self) -> frozenset[Path]:
        """Paths left out because a later hop runs behind this policy's plan."""
        return self._blocked

    @property
    def in_flight(self) -> Mapping[Path, int]:
        """Chunks chosen and not yet done, per path (a copy)."""
        return dict(self._in_flight)

    def choose(self, view: Callable[[int], LinkView] | None = None, size: int = 0) -> Path:
        """The path for the next chunk of ``size`` bytes; counts it as in flight on that path.
        ``view(neighbour)``: the sender's link to that neighbour (None: the paper's rule alone)."""
        path = self._pick(view, size)
        self._in_flight[path] += 1
        return path

    def lagging(self, view: LinkView) -> bool:
        """Whether the primary sends more than ``slowdown`` below its planned rate."""
        planned = self.planned_bps.get((self.primary[0], self.primary[1]))
        if view.rate_bps is None or planned is None:
            return False
        return view.rate_bps < planned * (1 - self.slowdown)

    def _pick(self, view: Callable[[int], LinkView] | None, size: int) -> Path:
        if self.enabled and self.offload:
            for path, fraction in self.offload:
                if path not in self._blocked:
                    self._credit[path] += fraction
            path = max(self._credit, key=lambda p: self._credit[p])
            if self._credit[path] >= 1.0 and path not in self._blocked:
                self._credit[path] -= 1.0
                return path
        if not self.enabled or self._in_flight[self.primary] <= self.busy_bound:
            return self.primary
        room = [p for p in self.aux if self._in_flight[p] < self.aux_queue_length and p not in self._blocked]
        if view is None or self.slowdown == 0:  # the paper's rule: the fastest path with room
            return room[0] if room else self.primary
        primary = view(self.primary[1])
        if not self.lagging(primary):
            return self.primary
        best, best_s = self.primary, self._delivery_s(self.primary, primary, size)
        for path in room:
            estimate = self._delivery_s(path, view(path[1]), size)
            if estimate < best_s:
                best, best_s = path, estimate
        return best

    def explore(self, first_hops: Collection[int]) -> Path | None:
        """The first (fastest) auxiliary path with room whose first hop is one of ``first_hops``, counted
        as in flight; None if there is none. The scheduler asks for links it has no measurement of to be
        explored: a chunk routed through one measures it, whatever the link's rate was believed to be."""
        if not self.enabled:
            return None
        for path in self.aux:
            if path[1] in first_hops and self._in_flight[path] < self.aux_queue_length and path not in self._blocked:
                self._in_flight[path] += 1
                return path
        return None

    def reroute(self, view: Callable[[int], LinkView], size: int, first_hop: int) -> Path | None:
        """For a chunk of ``size`` bytes already queued last on the primary: the auxiliary path through
        neighbour ``first_hop`` that delivers it sooner than the primary's backlog would, while the
        primary sends below ``reroute_below`` of its planned rate; None otherwise. The path is counted as
        in flight and the primary's count released (``done`` follows once the chunk left, on that path).

        A chunk's path is chosen when it is queued, and a leaf queues all its chunks when its trainer
        pushes: a link that slows down afterwards keeps every chunk it was given. Choosing again for
        the chunk that would leave last, when a link it could go through has nothing to send, lets the
        iteration the WAN changes under finish on the links that still have capacity. The bar is lower
        than ``slowdown``'s because moved chunks are many: right after a re-plan, links run well off
        plans made from a few reports, and moving their chunks then took capacity the new plan counted on.
        """
        if not self.enabled or self.slowdown == 0 or self.reroute_below == 0 or self._in_flight[self.primary] == 0:
            return None
        primary = view(self.primary[1])
        planned = self.planned_bps.get((self.primary[0], self.primary[1]))
        if not primary.rate_bps or not planned or primary.rate_bps >= planned * self.reroute_below:
            return None
        best, best_s = None, primary.backlog_bytes / primary.rate_bps
        for path in self.aux:
            if path[1] != first_hop or self._in_flight[path] >= self.aux_queue_length or path in self._blocked:
                continue
            estimate = self._delivery_s(path, view(first_hop), size)
            if estimate < best_s:
                best, best_s = path, estimate
        if best is not None:
            self._in_flight[self.primary] -= 1
            self._in_flight[best] += 1
        return best

    def _delivery_s(self, path: Path, first: LinkView, size: int) -> float:
        """Seconds until a chunk sent on ``path`` now would arrive, as far as the sender can tell."""
        rate = first.rate_bps if first.rate_bps is not None else self.planned_bps.get((path[0], path[1]))
        if not rate:
            return math.inf
        total = (first.backlog_bytes + size) / rate
        for hop in itertools.pairwise(path[1:]):
            hop_bps = self.believed_bps.get(hop) or self.planned_bps.get(hop)
            if not hop_bps:
                return math.inf
            total += size / hop_bps
        return total

    def done(self, path: Path) -> None:
        """A chunk sent on ``path`` has left the first hop's socket."""
        path = tuple(path)
        count = self._in_flight.get(path)
        if count is None:
            raise ValueError(f"path {path} is not one of this scheduler's paths "
                             f"({self.primary} and {len(self.aux)} auxiliary)")
        if count == 0:
            raise ValueError(f"path {path} has no chunk in flight")
        self._in_flight[path] = count - 1


def _check_offload(primary: Path, offload: Sequence[tuple[Path, float]]) -> None:
    for path, fraction in offload:
        if path[:1] != primary[:1] or path[-1:] != primary[-1:] or len(path) < 3 or len(set(path)) != len(path):
            raise ValueError(f"offload path {path} must be a detour from {primary[0]} to {primary[-1]}")
        if not 0 < fraction <= 1:
            raise ValueError(f"offload fraction of {path} must be in (0, 1], got {fraction}")
