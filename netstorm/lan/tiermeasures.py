"""What a gateway measures of its LAN tier: counters for operators (the node's ``netstorm_lan_*``
metrics), one log line per iteration with its LAN phase's times, and each worker's achieved rates, which
the scheduler is told when they moved enough (netstorm/lanreport.py's meter and schedule).

``LanMeasures`` is a sans-I/O core: it is handed the agent's readings (when an iteration's chunks were
summed, the uplink and downlink bursts) and the clock, and answers with the measured LAN to report, or
None. ``GatewayRole`` reads the agent and sends the report.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from netstorm.lan_scenario import LanSpec
from netstorm.lanreport import LanRateMeter, ReportSchedule, uplink_bounds

log = logging.getLogger("netstorm.edge")

Burst = tuple[str, tuple[int, int, float, float]]
"""``("up" | "down", (worker, bytes, first, last arrival))``: one burst the agent timed."""
RELEASES_KEPT = 4
"""Iterations back whose release time is kept (the phases of an iteration are timed from the previous one's)."""


class LanMeasures:
    """The LAN tier's counters, phase times and measured rates, iteration by iteration."""

    def __init__(self, lan: LanSpec | None, *, change: float, interval: float) -> None:
        """``lan``: the LAN's description (None: no rates are measured); ``change`` and ``interval``: the
        relative move and the least seconds between two reports (``ReportSchedule``)."""
        self.meter = LanRateMeter(lan, margin=change) if lan is not None else None
        """Each worker's achieved rates, from the data the gateway receives."""
        self.schedule = ReportSchedule(lan, change, interval) if lan is not None else None
        self.lan_iterations = 0
        """Iterations whose LAN sums the gateway collected."""
        self.lan_failures = 0
        """Iterations whose LAN sum failed (a timeout naming missing workers, an overflow, an abort)."""
        self.lan_bytes = 0
        """Bytes of float32 gradients the LAN summed: the model's size times the workers, per iteration."""
        self.lan_seconds = 0.0
        """Seconds of the LAN phases: from the previous result's release to the last chunk summed."""
        self.lan_last_gbit = 0.0
        """The newest LAN phase's throughput (its bytes over its seconds), Gbit/s; 0 before one."""
        self._released_at: dict[int, float] = {}
        """When each recent iteration's result was released to the LAN (the phases' reference)."""

    def released(self, iteration: int, now: float) -> None:
        """``iteration``'s result was released to the LAN at ``now`` (monotonic clock)."""
        self._released_at[iteration] = now
        for old in [k for k in self._released_at if k < iteration - RELEASES_KEPT]:
            del self._released_at[old]

    def failed(self) -> None:
        """An iteration's LAN sum failed."""
        self.lan_failures += 1

    def collected(self, iteration: int, nbytes: int, summed: tuple[float, float] | None, *, asked: float,
                  now: float, first_handed: float | None) -> None:
        """``iteration``'s LAN sums (``nbytes`` of gradients) were collected at ``now``: counted, and its
        phases logged, from which an iteration's time splits into the LAN's share and the WAN's: the
        previous result released -> first and last chunk summed (``summed``), when the node asked for the
        sum (``asked``) and how long it waited, and when its first part was handed (``first_handed``;
        None: the node took it whole). Times on the monotonic clock."""
        self.lan_iterations += 1
        self.lan_bytes += nbytes
        released = self._released_at.get(iteration - 1)
        if summed is None or released is None:
            return
        if summed[1] > released:
            self.lan_seconds += summed[1] - released
            self.lan_last_gbit = nbytes * 8 / (summed[1] - released) / 1e9
        parts = ("" if first_handed is None else
                 f"; its first part went to the WAN step {first_handed - released:.3f} s after that release")
        log.info("edge: iteration %d: LAN first chunk summed %.3f s and last %.3f s after the previous result was "
                 "released; the node asked for the sum %.3f s after that release and waited %.3f s%s",
                 iteration, summed[0] - released, summed[1] - released, asked - released, now - asked, parts)

    def measured(self, bursts: Sequence[Burst], clusters: Mapping[int, tuple[int, ...]], paces: Mapping[int, float],
                 now: float, *, reporting: bool) -> LanSpec | None:
        """Feed an iteration's bursts to the meter (an uplink sample bounded by what the gateway set, a pace
        or a cluster's members, is censored there); the measured LAN when it moved enough to report
        (``reporting``: someone takes reports), else None."""
        if self.meter is None or self.schedule is None:
            return None
        believed = {w.index: w.up_gbit for w in self.meter.measured().workers}
        bounds = uplink_bounds(self.meter.spec, clusters, paces, believed)
        for direction, (worker, nbytes, first, last) in bursts:
            if worker < len(self.meter.spec.workers):
                self.meter.on_burst(worker, direction, nbytes, first, last,
                                    bounds.get(worker) if direction == "up" else None)
        measured = self.meter.measured()
        if not reporting or not self.schedule.due(measured, now):
            return None
        self.schedule.sent(measured, now)
        log.info("edge: measured LAN (up, down Gbit/s) %s reported to the scheduler",
                 {w.index: (round(w.up_gbit, 4), round(w.down_gbit, 4)) for w in measured.workers})
        return measured


def lan_losses(agent: object) -> dict[str, int]:
    """Recoveries the LAN needed so far, by kind, as the agent counted them: NACK datagrams (each names
    missing workers' chunks), QUERY answers, NACKs to cluster aggregators; zeros for an agent that counts
    none (the TCP path, which loses nothing, or no agent yet)."""
    return {"nack": int(getattr(agent, "nack_datagrams", 0)),
            "query_nack": int(getattr(agent, "query_nacks_sent", 0)),
            "cluster_nack": int(getattr(agent, "cluster_nacks_sent", 0))}
