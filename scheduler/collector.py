"""The scheduler's network collector: the latest probe report per directed link, and what to believe
about links nobody has measured lately.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import dataclasses
import math
import statistics

from netstorm.config import Config
from netstorm.probe import LinkReport
from netstorm.scenario import Rates

DEFAULT_STALE_AFTER = Config.stale_after
RECENT = Config.belief_reports
"""Reports per link whose median is believed by default (``belief_reports``; 1: the newest alone, the
paper's rule)."""
DEFAULT_HALF_LIFE = Config.stale_half_life
CHANGE_WINDOW_S = 1.0
"""Seconds of reports ``change_seen`` weighs: a re-draw of the dynamic scenario shows on several links
within a second."""
CHANGE_MIN_LINKS = 3
"""Links whose newest report must be away from their plan for ``change_seen``: one or two are noise or
one link's own change."""


@dataclasses.dataclass(frozen=True)
class LinkState:
    """What the collector knows about one directed link."""

    mbit_s: float
    """What the collector believes now: the median of ``recent`` (or the initial rate)."""
    since: float
    """Scheduler time the value was made (report received, or collector start for initial rates)."""
    measured: bool
    samples: int = 0
    recent: tuple[float, ...] = ()
    """The collector's last ``recent`` reports, oldest first (the initial rate first, until it ages out)."""
    recent_at: tuple[float, ...] = ()
    """When each of ``recent`` was received (the collector's start for the initial rate)."""
    first_at: float = math.inf
    """When the link's first report came (inf before any)."""

    @property
    def latest(self) -> float:
        """The newest report as it came (the initial rate before any)."""
        return self.recent[-1] if self.recent else self.mbit_s


class LinkCollector:
    """Latest report per directed link, with estimates for stale and never-measured links."""

    def __init__(self, initial: Rates, *, now: float, stale_after: float = DEFAULT_STALE_AFTER,
                 half_life: float = DEFAULT_HALF_LIFE, recent: int = RECENT) -> None:
        if not initial:
            raise ValueError("a collector needs at least one link")
        for link, rate in initial.items():
            _check_rate(link, rate)
        if stale_after < 0 or half_life <= 0:
            raise ValueError(f"stale_after ({stale_after}) must be >= 0 and half_life ({half_life}) positive")
        if recent < 1:
            raise ValueError(f"a link's belief needs at least one report, got recent={recent}")
        self.stale_after = stale_after
        self.half_life = half_life
        self.recent = recent
        """Reports per link whose median is believed."""
        self._links: dict[tuple[int, int], LinkState] = {
            link: LinkState(float(rate), now, measured=False, recent=(float(rate),), recent_at=(now,))
            for link, rate in initial.items()
        }
        self.change_at: float | None = None
        """The latest change point (see ``note_change``), or None."""

    def add(self, report: LinkReport, now: float) -> None:
        """Take ``report`` as the link's latest value. Unknown links and impossible rates raise
        ValueError and change nothing."""
        link = (report.src, report.dst)
        if link not in self._links:
            raise ValueError(f"report for unknown link {report.src}->{report.dst}")
        _check_rate(link, report.mbit_s)
        before = self._links[link]
        # Stale reports say nothing now; those before a change point describe the old network.
        since = -math.inf if self.change_at is None else self.change_at
        if now - before.since > self.stale_after:
            since = math.inf
        kept = _reports_since(before, since)
        recent = (*kept, (now, float(report.mbit_s)))[-self.recent:]
        values = tuple(v for _, v in recent)
        self._links[link] = LinkState(statistics.median(values), now, measured=True, samples=report.samples,
                                      recent=values, recent_at=tuple(t for t, _ in recent),
                                      first_at=min(before.first_at, now))

    def moved(self, link: tuple[int, int], planned: float, threshold: float) -> int:
        """+1 or -1 when the link's last two reports, its first excluded (TCP still opening its windows),
        are both more than ``threshold`` (relative) above or below ``planned``; 0 otherwise. A host stall
        skews one report, not two."""
        s = self._links[link]
        real = [v for t, v in zip(s.recent_at, s.recent, strict=True) if t > s.first_at][-2:]
        sides = {0 if abs(v - planned) <= threshold * planned else (1 if v > planned else -1) for v in real}
        return sides.pop() if len(real) == 2 and len(sides) == 1 else 0

    def change_seen(self, planned: Rates, threshold: float, *, now: float, window: float = CHANGE_WINDOW_S,
                    min_links: int = CHANGE_MIN_LINKS) -> float | None:
        """When the network changed, if the links reported in the last ``window`` seconds say it did: the
        newest report of at least ``min_links`` of them more than ``threshold`` (relative) from the plan,
        of at least half as many as stayed within it (a re-draw leaves many links there), some above the
        plan and some below (a host too busy to read its sockets slows every link at once), and at least
        one of them ``moved`` (two reports on the same side: a host stall skews one report per link, not
        two). A link's first report counts for nothing. The change began at the first report away."""
        away = stayed = anchors = 0
        first = math.inf
        sides: set[bool] = set()
        for link, s in self._links.items():
            if link not in planned or s.since < now - window or s.since <= s.first_at:
                continue
            rate = planned[link]
            if abs(s.latest - rate) <= threshold * rate:
                stayed += 1
                continue
            away += 1
            sides.add(s.latest > rate)
            if self.moved(link, rate, threshold):
                anchors += 1
                first = min(first, s.recent_at[-2])
            else:
                first = min(first, s.since)
        return first if anchors and away >= min_links and 2 * away >= stayed and len(sides) == 2 else None

    def note_change(self, at: float, *, change_gap: float) -> bool:
        """Mark a change of the network at ``at``, unless one was marked less than ``change_gap`` before
        it (the same change, seen on another link); True if marked. Reports received before ``at`` stop
        counting, and links with none since are ``unconfirmed``."""
        if self.change_at is not None and at - self.change_at < change_gap:
            return False
        self.change_at = at
        for link, s in self._links.items():
            kept = _reports_since(s, at)
            if kept:
                values = tuple(v for _, v in kept)
                self._links[link] = dataclasses.replace(s, mbit_s=statistics.median(values), recent=values,
                                                        recent_at=tuple(t for t, _ in kept))
        return True

    def unconfirmed(self, src: int, dst: int) -> bool:
        """Not measured since the last change point: believed halfway toward the links that were."""
        return self.change_at is not None and self._links[(src, dst)].since < self.change_at

    def state(self, src: int, dst: int) -> LinkState:
        """The stored state of link ``src -> dst``."""
        return self._links[(src, dst)]

    def estimate(self, now: float) -> Rates:
        """Rates to plan with at ``now``: fresh values as they are, stale ones decayed toward the optimum."""
        target = max(s.mbit_s for s in self._links.values())
        out: Rates = {}
        for link, s in self._links.items():
            age = now - s.since - self.stale_after
            if age <= 0 or s.mbit_s >= target:
                out[link] = s.mbit_s
            else:
                keep = 0.5 ** (age / self.half_life)
                out[link] = target - (target - s.mbit_s) * keep
        unconfirmed = {link for link in self._links if self.unconfirmed(*link)}
        confirmed = [rate for link, rate in out.items() if link not in unconfirmed]
        if unconfirmed and confirmed:
            typical = statistics.median(confirmed)
            for link in unconfirmed:
                out[link] = (out[link] + typical) / 2
        return out

    @staticmethod
    def relative_change(old: Rates, new: Rates) -> float:
        """The largest relative change of any link between two estimates (inf if the link sets differ)."""
        if old.keys() != new.keys():
            return math.inf
        return max((abs(new[k] - old[k]) / old[k] for k in old), default=0.0)


def _check_rate(link: tuple[int, int], rate: float) -> None:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"link {link[0]}->{link[1]}: rate must be a positive finite Mbit/s, got {rate!r}")


def _reports_since(s: LinkState, t: float) -> tuple[tuple[float, float], ...]:
    """(time, rate) of the link's recent reports received at ``t`` or later."""
    return tuple((at, v) for at, v in zip(s.recent_at, s.recent, strict=True) if at >= t)
