"""Which of the scheduler's LAN plans a gateway follows, and from when: a plan older than the followed one
is ignored, so is one naming workers the LAN lacks or clusters on the one-level TCP path; before the LAN
tier starts a plan's deployment is taken at once, while it runs a changed deployment waits for the next
released result (``GatewayRole._switch``: an iteration boundary) and a plan of the same deployment (new
rates only) is taken at once. Plain functions of the gateway's state: ``GatewayRole.apply_lan_plan``
applies what they decide.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from netstorm.control import LanPlan
from netstorm.errors import ConfigError
from netstorm.lan.deploy import LanTopology

log = logging.getLogger("netstorm.edge")


def topology_from_plan(plan: LanPlan, workers: int) -> LanTopology:
    """The data plane's configuration of a ``LanPlan``: its clusters; every worker it sends straight to
    the gateway (or does not name) is unclustered. ConfigError when it names workers this LAN lacks."""
    clusters, _direct = plan.two_level()
    return LanTopology(workers, {a: tuple(m) for a, m in clusters.items()})


@dataclass(frozen=True)
class Intake:
    """A plan the gateway takes: its deployment, and whether it is followed at once."""

    topology: LanTopology
    now: bool
    """False: a changed deployment while the LAN tier runs, pending until the next released result."""


def intake(plan: LanPlan, followed: LanPlan | None, *, workers: int, one_level: bool, running: bool,
           current: LanTopology) -> Intake | None:
    """What the gateway does with ``plan`` (None: ignores it). ``followed``: the plan it follows (None:
    none yet); ``one_level``: the TCP path, which has no clusters; ``running``: the LAN tier started;
    ``current``: the deployment it runs (or will start with)."""
    if followed is not None and plan.version <= followed.version:
        return None
    try:
        topology = topology_from_plan(plan, workers)
    except ConfigError as exc:
        log.error("edge: %s plan %d ignored: %s", plan.planner, plan.version, exc)
        return None
    if one_level and topology.clusters:
        log.error("edge: %s plan %d has clusters; the tcp path is one level and keeps every worker sending "
                  "to the gateway", plan.planner, plan.version)
        return None
    if running and topology != current:
        log.info("edge: %s plan %d arrived while the LAN tier runs; its deployment (clusters %s) takes "
                 "effect from the iteration after the next released result", plan.planner, plan.version,
                 dict(topology.clusters))
        return Intake(topology, now=False)
    log.info("edge: %s plan %d deployed: clusters %s; the aggregators and unclustered workers %s send to the "
             "gateway", plan.planner, plan.version, dict(topology.clusters), list(topology.unclustered))
    return Intake(topology, now=True)


def paces(plan: LanPlan | None, *, pace_rates: bool, rate_scale: float) -> dict[int, float]:
    """Per worker, the Gbit/s its HELLO answer tells it to pace to: ``plan``'s rate x ``rate_scale`` with
    ``pace_rates``, else none (nor without a plan, nor for a worker the plan gives no rate)."""
    if not pace_rates or plan is None:
        return {}
    return {w: r * rate_scale for w, r in plan.rates if r > 0}
