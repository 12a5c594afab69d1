"""Which of the scheduler's LAN plans a gateway takes, and from when, by plain calls: older plans and plans
it cannot run are ignored, a deployment is taken at once before the tier starts and while it runs only
when unchanged (else it waits), and the paces a plan sets."""

from __future__ import annotations

import pytest

from netstorm.control import LanPlan
from netstorm.lan.deploy import LanTopology
from netstorm.lan.planintake import Intake, intake, paces, topology_from_plan

WORKERS = 4
FLAT = LanTopology(WORKERS)
CLUSTERED = LanTopology(WORKERS, {0: (1, 2)})


def _plan(version: int, clusters: dict[int, tuple[int, ...]] | None = None,
          rates: tuple[tuple[int, float], ...] = ()) -> LanPlan:
    clusters = clusters or {}
    members = {m for ms in clusters.values() for m in ms}
    return LanPlan(node_id=1, version=version, planner="aleph", clusters=tuple(clusters.items()),
                   direct=tuple(w for w in range(WORKERS) if w not in members), rates=rates)


def _take(plan: LanPlan, followed: LanPlan | None = None, *, one_level: bool = False, running: bool = False,
          current: LanTopology = FLAT) -> Intake | None:
    return intake(plan, followed, workers=WORKERS, one_level=one_level, running=running, current=current)


def test_before_the_tier_runs_a_plan_is_deployed_at_once_and_an_older_one_is_ignored() -> None:
    plan = _plan(2, {0: (1, 2)})
    assert _take(plan) == Intake(CLUSTERED, now=True)
    assert _take(_plan(2), followed=plan) is None
    assert _take(_plan(1), followed=plan) is None
    assert _take(_plan(3), followed=plan) == Intake(FLAT, now=True)


def test_while_the_tier_runs_a_changed_deployment_waits_and_new_rates_alone_are_taken_at_once() -> None:
    assert _take(_plan(2, {0: (1, 2)}), running=True, current=FLAT) == Intake(CLUSTERED, now=False)
    assert _take(_plan(2, {0: (1, 2)}), running=True, current=CLUSTERED) == Intake(CLUSTERED, now=True)


def test_a_plan_naming_workers_the_lan_lacks_or_clusters_on_the_tcp_path_is_ignored() -> None:
    assert _take(_plan(1, {0: (1, 7)})) is None
    assert _take(_plan(1, {0: (1, 2)}), one_level=True) is None
    assert _take(_plan(1), one_level=True) == Intake(FLAT, now=True)
    assert topology_from_plan(_plan(1, {3: (0,)}), WORKERS) == LanTopology(WORKERS, {3: (0,)})


def test_paces_are_the_plans_rates_scaled_only_when_pacing_is_on() -> None:
    plan = _plan(1, rates=((0, 1.0), (1, 0.0), (2, 2.5)))
    assert paces(plan, pace_rates=True, rate_scale=0.1) == pytest.approx({0: 0.1, 2: 0.25})   # no rate: unpaced
    assert paces(plan, pace_rates=False, rate_scale=0.1) == {}
    assert paces(None, pace_rates=True, rate_scale=0.1) == {}
