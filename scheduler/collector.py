"""The scheduler's network collector: the latest probe report per directed link, and what to believe
about links nobody has measured lately.

The avalanche effect. Probes ride on the model's chunks, so a link that no tree uses is never
measured. If its estimate stayed at whatever it was when it dropped out of the trees (often a bad
moment: that is why it dropped out), it would never be chosen again even after its real rate recovered,
and the trees would shrink onto fewer and fewer links. Auxiliary paths measure some idle links; for
the rest, optimism under uncertainty:

* Fresh information is believed: the median of a link's last three reports (fewer while it has fewer),
  or the scenario's initial rate for a link never measured, for ``stale_after`` seconds after the last
  report (since the collector started, for the initial rates). The median drops a lone outlier (a
  receiver descheduled for a moment makes one report read far too fast or too slow, and a plan built on
  it overloads the link) and still follows a real change from its second report on.
* The initial rate counts as the first report, if the real first comes within ``stale_after``: a
  connection's first report reads low while TCP's windows open, and on a loaded host, alone, it
  re-planned runs whose initial rates were exact a few seconds after the start. Now the first report
  moves the belief halfway (the median of two is their mean) and the second decides.
* After that the estimate decays exponentially, with ``half_life``, from that value toward an
  optimistic target: the largest rate currently believed for any link. A stale slow link therefore
  becomes attractive after a while, gets a tree edge or an auxiliary path, is measured, and its real
  rate takes over. Exploration costs at most one re-plan on a slow link per ``stale_after`` plus a few
  half-lives, instead of losing the link forever. Stale values above the target stay as they are (they
  are already attractive and will be measured).

``stale_after=math.inf`` turns the decay off (every link keeps its last value).

Relative change. ``relative_change(old, new)`` is the largest relative change of any link,
``max |new - old| / old``: one link whose rate halves can reshape the trees, however many others are
steady, so it must not be averaged away. A link present in only one of the two counts as infinite.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from netstorm.config import Config
from netstorm.probe import LinkReport
from netstorm.scenario import Rates

DEFAULT_STALE_AFTER = Config.stale_after
RECENT = 3
"""Reports per link whose median is believed."""
DEFAULT_HALF_LIFE = Config.stale_half_life


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
    """The last ``RECENT`` reports, oldest first (the initial rate first, until it ages out)."""

    @property
    def latest(self) -> float:
        """The newest report as it came (the initial rate before any)."""
        return self.recent[-1] if self.recent else self.mbit_s


class LinkCollector:
    """Latest report per directed link, with estimates for stale and never-measured links."""

    def __init__(self, initial: Rates, *, now: float, stale_after: float = DEFAULT_STALE_AFTER,
                 half_life: float = DEFAULT_HALF_LIFE) -> None:
        if not initial:
            raise ValueError("a collector needs at least one link")
        for link, rate in initial.items():
            _check_rate(link, rate)
        if stale_after < 0 or half_life <= 0:
            raise ValueError(f"stale_after ({stale_after}) must be >= 0 and half_life ({half_life}) positive")
        self.stale_after = stale_after
        self.half_life = half_life
        self._links: dict[tuple[int, int], LinkState] = {
            link: LinkState(float(rate), now, measured=False, recent=(float(rate),)) for link, rate in initial.items()
        }

    def add(self, report: LinkReport, now: float) -> None:
        """Take ``report`` as the link's latest value. Unknown links and impossible rates raise
        ValueError and change nothing."""
        link = (report.src, report.dst)
        if link not in self._links:
            raise ValueError(f"report for unknown link {report.src}->{report.dst}")
        _check_rate(link, report.mbit_s)
        before = self._links[link]
        kept = before.recent if now - before.since <= self.stale_after else ()  # stale reports say nothing now
        recent = (*kept, float(report.mbit_s))[-RECENT:]
        self._links[link] = LinkState(statistics.median(recent), now, measured=True, samples=report.samples,
                                      recent=recent)

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
