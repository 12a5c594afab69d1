"""Passive LAN rate reports: what a gateway tells the scheduler about its LAN, and how it measures it.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from netstorm.control import LanRackRow, LanReport, LanWorkerRow
from netstorm.lan_scenario import LanSpec, LanWorker, Rack

MIN_BURST_BYTES = 64 * 1024
"""Bursts shorter than this say more about interrupt timing than about a port: ignored."""


def report_from_spec(node_id: int, spec: LanSpec, *, measured: bool = False, t: float = 0.0) -> LanReport:
    """The ``LanReport`` that describes ``spec``."""
    workers = tuple(LanWorkerRow(w.index, w.up_gbit, w.down_gbit, w.compute_s, w.precision,
                                 -1 if w.rack is None else w.rack, w.agg_gbit or 0.0) for w in spec.workers)
    racks = tuple(LanRackRow(r.id, r.aggregator_gbit, r.uplink_gbit, r.precision_gbit) for r in spec.racks)
    return LanReport(node_id=node_id, gateway_gbit=spec.gateway_gbit, workers=workers, racks=racks,
                     measured=measured, t=t)


def spec_from_report(report: LanReport) -> LanSpec:
    """The ``LanSpec`` a report describes."""
    workers = tuple(LanWorker(w.index, w.up_gbit, w.down_gbit, w.compute_s, w.precision,
                              None if w.rack < 0 else w.rack, w.agg_gbit or None)
                    for w in sorted(report.workers, key=lambda w: w.index))
    racks = tuple(Rack(r.id, r.aggregator_gbit, r.uplink_gbit, tuple(r.precision_gbit)) for r in report.racks)
    return LanSpec(workers, racks, report.gateway_gbit)


def uplink_bounds(spec: LanSpec, clusters: Mapping[int, tuple[int, ...] | list[int]],
                  paces: Mapping[int, float], believed: Mapping[int, float] | None = None) -> dict[int, float]:
    """Per worker, the Gbit/s its uplink sample cannot exceed because of what the gateway set: its own pace,
    and for a cluster aggregator the least of its own pace and each member's pace (or, for an unpaced member,
    its believed uplink: ``believed``, else the described one). A worker absent is unbounded."""
    up = {w.index: w.up_gbit for w in spec.workers}
    if believed is not None:
        up.update(believed)
    bounds = {w: float(p) for w, p in paces.items() if p > 0}
    for aggregator, members in clusters.items():
        feeds = [bounds.get(m, up.get(m, float("inf"))) for m in members if m != aggregator]
        own = bounds.get(aggregator, float("inf"))
        bound = min([own, *feeds])
        if bound < float("inf"):
            bounds[aggregator] = bound
    return bounds


@dataclass
class LanRateMeter:
    """Per worker and direction, the right-censored median rate of its recent bursts (sans-I/O)."""

    spec: LanSpec
    """What the gateway was configured with: rates stand until measured."""
    window: int = 8
    min_samples: int = 3
    margin: float = 0.2
    """A sample below ``bound x (1 - margin)`` is a real drop; at or above it the sample is censored."""
    _samples: dict[tuple[int, str], collections.deque[tuple[float, float | None]]] = field(default_factory=dict)
    """(rate, None) for a measured sample, (rate, bound) for a censored one."""
    _belief: dict[tuple[int, str], float] = field(default_factory=dict)

    def on_burst(self, worker: int, direction: str, nbytes: int, first_t: float, last_t: float,
                 bound: float | None = None) -> None:
        """A burst of ``nbytes`` from (``up``) or to (``down``) ``worker`` spanning first_t..last_t; ``bound``:
        the Gbit/s the gateway's own pacing held it to, if any (see the module's docstring)."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        span = last_t - first_t
        if nbytes < MIN_BURST_BYTES or span <= 0:
            return
        key = (worker, direction)
        samples = self._samples.setdefault(key, collections.deque(maxlen=self.window))
        rate = nbytes * 8 / span / 1e9
        censored = bound is not None and bound > 0 and rate >= bound * (1 - self.margin)
        samples.append((rate, bound if censored else None))
        believed = self._median(samples)
        if believed is not None:
            self._belief[key] = believed
        elif len(samples) >= self.min_samples:
            floor = min(b for _, b in samples if b is not None)
            if self._believed(worker, direction) < floor:
                self._belief[key] = floor

    def _believed(self, worker: int, direction: str) -> float:
        """The believed rate, else the configured one (inf for a worker the spec does not describe)."""
        belief = self._belief.get((worker, direction))
        if belief is not None:
            return belief
        for w in self.spec.workers:
            if w.index == worker:
                return w.up_gbit if direction == "up" else w.down_gbit
        return float("inf")

    def _median(self, samples: collections.deque[tuple[float, float | None]]) -> float | None:
        """The median with censored samples ranked above every measured one; None when it is censored."""
        if len(samples) < self.min_samples:
            return None
        ranked = sorted(samples, key=lambda s: (s[1] is not None, s[0]))
        n = len(ranked)
        middle = ranked[(n - 1) // 2: n // 2 + 1]
        if any(b is not None for _, b in middle):
            return None
        return sum(r for r, _ in middle) / len(middle)

    def rate(self, worker: int, direction: str) -> float | None:
        """The believed rate; None while the direction has no measured belief (the configured rate stands)."""
        return self._belief.get((worker, direction))

    def measured(self) -> LanSpec:
        """The configured LAN with every believed rate replaced by its measurement."""
        workers = []
        for w in self.spec.workers:
            up, down = self.rate(w.index, "up"), self.rate(w.index, "down")
            workers.append(replace(w, up_gbit=up or w.up_gbit, down_gbit=down or w.down_gbit))
        return replace(self.spec, workers=tuple(workers))

    def report(self, node_id: int, t: float) -> LanReport:
        return report_from_spec(node_id, self.measured(), measured=True, t=t)


def largest_change(old: LanSpec, new: LanSpec) -> float:
    """Largest relative change of a worker's rate between two descriptions of one LAN; inf when they
    describe different LANs (workers, precisions, racks or the gateway changed)."""
    if (len(old.workers) != len(new.workers) or old.racks != new.racks or old.gateway_gbit != new.gateway_gbit
            or any((a.precision, a.rack, a.agg_gbit) != (b.precision, b.rack, b.agg_gbit)
                   for a, b in zip(old.workers, new.workers, strict=True))):
        return float("inf")
    change = 0.0
    for a, b in zip(old.workers, new.workers, strict=True):
        for x, y in ((a.up_gbit, b.up_gbit), (a.down_gbit, b.down_gbit)):
            change = max(change, abs(y - x) / x)
    return change


@dataclass
class ReportSchedule:
    """When a gateway sends its measured LAN to the scheduler (sans-I/O, clock injected): once a worker's
    measured rate moved by more than ``change`` against what it last reported (first: its configured
    description), and at most once per ``interval`` seconds, so the scheduler hears of a moved LAN without
    a report per iteration."""

    reported: LanSpec
    """What the scheduler last heard: the configured description until the first measured report."""
    change: float
    interval: float
    last_t: float | None = None

    def due(self, measured: LanSpec, now: float) -> bool:
        if self.last_t is not None and now - self.last_t < self.interval:
            return False
        moved = largest_change(self.reported, measured)
        return moved > self.change or (self.change == 0 and moved > 0)

    def sent(self, measured: LanSpec, now: float) -> None:
        self.reported = measured
        self.last_t = now
