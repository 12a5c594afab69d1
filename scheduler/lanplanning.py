"""The scheduler's planning of each DC's LAN tier (sans-I/O): LAN reports in, plans to push out.

A gateway node describes its LAN (``LanReport``: as configured, then as measured); a DC is due for a
plan when it has none, when its LAN changed shape (workers, precisions, racks), or when one worker's
rate moved by more than ``dc_replan_change`` against the rates its current plan was made from. A plan
from measured rates waits until ``dc_replan_hold`` seconds after the DC's previous plan (the clock is
injected: ``now`` in, ``next_deadline`` out for the shell's timer), so measurements that wander re-plan
a DC at most that often, and the last report of a moved LAN is planned when the hold ends even if no
report follows it. The
planner named by ``dc_planner`` runs on the DC's description with workers only as aggregators (the
data plane runs worker aggregators, two levels deep) and its plan goes to the gateway as a ``LanPlan``
in the data plane's two-level form. The shell (``scheduler/service.py``) runs ``compute`` in a worker
thread; ``begin`` and ``finish`` run on its event loop, so a report arriving while a DC is planned is
looked at again when that plan is finished.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from netstorm import lanreport
from netstorm.config import Config
from netstorm.control import LanPlan, LanReport
from netstorm.errors import PolicyError
from netstorm.lan_scenario import LanSpec
from netstorm.planning.dcplan import Options, plan_dc
from netstorm.planning.lanmodel import DcPlan, two_level

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One DC to plan: what it is planned from."""

    node_id: int
    spec: LanSpec
    planner: str
    options: Options


class LanPlanning:
    def __init__(self, config: Config) -> None:
        self.planner = config.dc_planner
        self.options = Options.from_config(config, tor=False)
        self.change = config.dc_replan_change
        self.hold = config.dc_replan_hold
        self._planned_at: dict[int, float] = {}
        self._measured: set[int] = set()
        """DCs whose latest report is a measurement (held down), not a description."""
        self._latest: dict[int, LanSpec] = {}
        self._planned: dict[int, LanSpec] = {}
        self._version: dict[int, int] = {}
        self._busy: set[int] = set()
        self.plans: dict[int, LanPlan] = {}
        """DC -> the plan last pushed to it."""

    def report(self, message: LanReport, now: float = 0.0) -> bool:
        """Take a gateway's report; True when its DC is now due for a plan."""
        self._latest[message.node_id] = lanreport.spec_from_report(message)
        if message.measured:
            self._measured.add(message.node_id)
        else:
            self._measured.discard(message.node_id)
        return self.due(message.node_id, now)

    def _moved(self, node_id: int) -> float:
        """How far the latest report is from what the current plan was made from (inf: no plan yet, or
        another shape)."""
        planned = self._planned.get(node_id)
        return float("inf") if planned is None else lanreport.largest_change(planned, self._latest[node_id])

    def _held_until(self, node_id: int) -> float:
        """Until when a DC's plan from measured rates waits (its previous plan plus the hold)."""
        if node_id not in self._measured or node_id not in self._planned_at:
            return float("-inf")
        return self._planned_at[node_id] + self.hold

    def due(self, node_id: int, now: float = 0.0) -> bool:
        if node_id in self._busy or node_id not in self._latest:
            return False
        change = self._moved(node_id)
        if change == float("inf"):
            return True
        if not (change > self.change or (self.change == 0 and change > 0)):
            return False
        return now >= self._held_until(node_id)

    def next_deadline(self) -> float | None:
        """When a DC whose measured LAN moved comes out of its hold (None: no DC waits)."""
        waiting = [self._held_until(n) for n in self._latest
                   if n not in self._busy and self._moved(n) != float("inf")
                   and (self._moved(n) > self.change or (self.change == 0 and self._moved(n) > 0))]
        return min(waiting, default=None)

    def pending(self, now: float = 0.0) -> list[int]:
        """DCs due for a plan now."""
        return [n for n in sorted(self._latest) if self.due(n, now)]

    def begin(self, node_id: int, now: float = 0.0) -> Job:
        self._busy.add(node_id)
        self._planned_at[node_id] = now
        return Job(node_id, self._latest[node_id], self.planner, self.options)

    @staticmethod
    def compute(job: Job) -> DcPlan:
        """The planner's work (in a worker thread: EINA may take up to its time limit)."""
        return plan_dc(job.spec, job.planner, job.options)

    def finish(self, job: Job, plan: DcPlan | None, error: str = "") -> LanPlan | None:
        """Record the plan made for ``job``; the message to push, or None when it failed."""
        self._busy.discard(job.node_id)
        if plan is None:
            log.error("DC %d: %s plan failed, keeping the previous one: %s", job.node_id, job.planner, error)
            self._planned[job.node_id] = job.spec  # not retried until the LAN changes again
            return None
        try:
            clusters, direct = two_level(plan)
        except PolicyError as exc:
            log.error("DC %d: %s", job.node_id, exc)
            self._planned[job.node_id] = job.spec
            return None
        self._planned[job.node_id] = job.spec
        if plan.fallback:
            log.warning("DC %d: %s", job.node_id, plan.notes[-1])
        version = self._version.get(job.node_id, -1) + 1
        self._version[job.node_id] = version
        message = LanPlan(node_id=job.node_id, version=version, planner=plan.planner,
                          clusters=tuple((a, tuple(m)) for a, m in clusters.items()), direct=tuple(direct),
                          rates=tuple(sorted(plan.rates.items())), predicted_gbit=plan.prediction.gbit,
                          notes="; ".join(plan.notes))
        self.plans[job.node_id] = message
        return message
