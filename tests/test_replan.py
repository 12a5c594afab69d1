"""The scheduler's re-plan rules (scheduler/replan.py) by plain calls with a fake clock: reports in,
re-plans, publications and pushed beliefs out, the planner run in line where the shell uses a thread."""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Sequence

import pytest

from netstorm import control, scenario
from netstorm.config import Config
from netstorm.planning.offload import plan_offload
from netstorm.planning.predict import predict
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from netstorm.scenario import Rates
from scheduler.cadence import Reason
from scheduler.collector import LinkCollector
from scheduler.consistency import Consistency
from scheduler.planner import Planner, PlanningError
from scheduler.replan import Action, Log, Plan, PlanMoves, Publish, PushBeliefs, Replanner

SQUARE = scenario.parse({
    "name": "square",
    "node": [{"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}],
    "link": [{"a": 1, "b": 2, "rate_mbit": 100}, {"a": 2, "b": 3, "rate_mbit": 50},
             {"a": 3, "b": 4, "rate_mbit": [80, 30]}, {"a": 4, "b": 1, "rate_mbit": 60},
             {"a": 1, "b": 3, "rate_mbit": 20}],
})
RATES = SQUARE.rates()
FAST = Config(heartbeat_interval=0.1, heartbeat_timeout=1.0, update_time=60.0, connect_timeout=5.0)


class Job:
    """A re-plan core with its planner and consistency, whose actions are carried out in line."""

    def __init__(self, config: Config = FAST, rates: Rates = RATES, nodes: Sequence[int] = (1, 2, 3, 4),
                 topology: str = "fapt") -> None:
        self.consistency = Consistency()
        self.planner = Planner(topology=topology, num_roots=config.num_root_servers,
                               update_rate=config.update_rate, relative_change=LinkCollector.relative_change,
                               packing=config.tree_packing, replan_gain=config.replan_gain,
                               offload=config.enable_aux_path)
        self.core = Replanner(config, rates, nodes, planner=self.planner, consistency=self.consistency, now=0.0)
        self.alive = tuple(nodes)
        self.plans: list[Plan] = []
        self.published: list[tuple[int, str]] = []
        self.pushed: list[control.LinkBeliefs] = []
        self.logs: list[str] = []
        self.run([self.core.first_plan(self.alive)])

    def run(self, actions: Sequence[Action]) -> None:
        queue = collections.deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Plan):
                self.plans.append(action)
                policy = self.planner.first(action.rates, action.nodes) if action.current is None else \
                    self.planner.replan(action.rates, action.nodes, action.current, force=action.force)
                queue.extend(self.core.planned(action, policy, alive=self.alive))
            elif isinstance(action, Publish):
                self.consistency.publish(action.policy)
                self.published.append((action.policy.version, action.reason))
            elif isinstance(action, PlanMoves):
                old = action.old
                _, moves = plan_offload(action.beliefs.rates, old.trees, old.chunk_share, old.aux_paths,
                                        fixed_shares=True)
                queue.extend(self.core.moves_planned(action, moves))
            elif isinstance(action, PushBeliefs):
                self.pushed.append(action.beliefs)
            else:
                assert isinstance(action, Log)
                self.logs.append(action.message % action.args)

    def report(self, src: int, dst: int, mbit_s: float, now: float) -> None:
        self.run(self.core.link_report(LinkReport(src=src, dst=dst, mbit_s=mbit_s, t=now, samples=4), now))

    def tick(self, now: float) -> None:
        self.run(self.core.timer(now, alive=self.alive, complete=True))

    def override(self, rates: Rates, reason: str = "override") -> None:
        self.run([self.core.plan(rates, self.alive, force=True, reason=reason)])

    def policy(self, version: int) -> Policy:
        policy = self.consistency.policy(version)
        assert isinstance(policy, Policy)
        return policy

    @property
    def current(self) -> Policy:
        assert self.consistency.current_version is not None
        return self.policy(self.consistency.current_version)


def test_the_first_plan_is_published_at_version_zero_and_explores_nothing() -> None:
    job = Job(FAST.replace(enable_aux_path=True))
    assert job.published == [(0, "first plan")]
    assert job.plans[0].current is None and job.plans[0].rates == RATES
    assert job.current.explore == frozenset(), "nothing to explore before the network changed"
    assert job.pushed == [], "nobody runs an older policy yet"


def test_quiet_cycles_keep_the_policy_and_reports_replan_at_the_next_period() -> None:
    job = Job(FAST.replace(update_time=0.2, update_rate=0.5))
    first = job.current
    assert job.core.next_deadline() == pytest.approx(0.2)
    job.tick(0.1)
    assert job.core.cycles == 0, "not due yet"
    job.tick(0.2)
    job.tick(0.4)
    assert job.core.cycles == 2 and job.consistency.current_version == 0, "nothing measured: no new policy"
    job.report(4, 2, 9.0, now=0.5)  # not a link
    job.report(4, 2, 9.0, now=0.5)
    assert [line for line in job.logs if "ignored" in line] == [
        "link reports 4->2 ignored (said once): report for unknown link 4->2"]
    # The scenario's rate is the first vote: two reports carry the link's new rate.
    job.report(1, 2, 2.0, now=0.5)
    job.report(1, 2, 2.0, now=0.55)
    assert job.core.collector.state(1, 2).mbit_s == 2.0
    job.tick(0.7)
    assert job.published[-1] == (1, Reason.PERIODIC.value)
    changed = job.current
    assert changed.roots == first.roots, "roots never move"
    assert changed.trees != first.trees
    assert job.planner.planned_rates is not None and job.planner.planned_rates[(1, 2)] == 2.0


def test_a_report_far_from_the_plan_replans_at_once() -> None:
    job = Job(FAST.replace(react_change=0.3, react_interval=0.0))  # update_time 60 s: never due here
    planned = RATES[(1, 2)]
    for now, near in ((1.0, planned * 1.1), (1.1, planned * 1.2)):
        job.report(1, 2, near, now)
        assert job.core.cadence.reason() is Reason.PERIODIC, "within react_change"
    assert job.core.next_deadline() == 60.0
    # The collector believes the median of the last three reports: one far report is not enough.
    job.report(1, 2, planned * 0.2, now=1.2)
    assert job.core.cadence.reason() is Reason.PERIODIC and job.core.next_deadline() == 60.0
    job.report(1, 2, planned * 0.2, now=1.3)
    assert job.core.cadence.reason() is Reason.SHIFT and job.core.next_deadline() <= 1.3
    job.tick(1.3)
    assert job.published[-1] == (1, Reason.SHIFT.value)
    assert job.planner.planned_rates is not None and job.planner.planned_rates[(1, 2)] == planned * 0.2


def report_round(job: Job, now: float, up: list[tuple[int, int]], down: tuple[int, int], scale: float,
                 down_scale: float | None) -> None:
    """One report per ``up`` link at ``scale`` x its rate, and one for ``down`` unless ``down_scale`` is None."""
    for src, dst in up:
        job.report(src, dst, RATES[(src, dst)] * scale, now)
    if down_scale is not None:
        job.report(*down, RATES[down] * down_scale, now)


def test_several_links_moving_together_mark_a_change_and_replan_at_once() -> None:
    job = Job(FAST.replace(react_change=0.3, react_interval=0.0, replan_gain=0.0))
    up, down = [(2, 3), (3, 4), (1, 4)], (2, 1)
    # Faster links never slow the policy, and one report below its plan moves no belief: only the change
    # point can re-plan early here. First reports count for nothing.
    report_round(job, 1.0, up, down, 1.0, 1.0)
    report_round(job, 1.2, up, down, 3.0, None)
    assert job.core.collector.change_at is None, "every link that moved moved up"
    assert job.core.next_deadline() == 60.0
    report_round(job, 1.4, up, down, 3.0, 0.5)
    assert job.core.collector.change_at == 1.2
    assert any(line.startswith("network change 0.20 s ago") for line in job.logs)
    assert job.core.next_deadline() <= 1.4, "due at once"
    job.tick(1.4)
    assert job.published[-1] == (1, Reason.SHIFT.value)
    planned = job.planner.planned_rates
    assert planned is not None
    assert all(planned[link] == RATES[link] * 3.0 for link in up)
    assert planned[down] == RATES[down] * 0.5, "its report since the change alone"


def test_after_a_change_policies_explore_idle_links_and_their_news_replans() -> None:
    job = Job(FAST.replace(react_change=0.3, react_interval=0.0, replan_gain=0.0, num_root_servers=1))
    up, down = [(2, 3), (3, 4), (1, 4)], (2, 1)
    for now, (scale, down_scale) in zip((1.0, 1.2, 1.4), ((1.0, 1.0), (3.0, None), (3.0, 0.5)), strict=True):
        report_round(job, now, up, down, scale, down_scale)
    job.tick(1.4)
    changed = job.policy(1)
    idle = {link for link in RATES if link not in changed.tree_links() and link not in {*up, down}}
    assert idle, "one tree over four nodes leaves links idle"
    assert changed.explore == idle
    planned = job.planner.planned_rates
    assert planned is not None
    steady, fast = sorted(idle)[:2]
    job.report(*steady, planned[steady], now=1.5)
    assert job.core.collector.state(*steady).measured
    assert job.core.cadence.reason() is Reason.PERIODIC, "an explored link at its believed rate changes nothing"
    assert job.core.next_deadline() == pytest.approx(61.4)
    job.report(*fast, planned[fast] * 3, now=1.6)
    assert job.core.cadence.reason() is Reason.SHIFT, "an explored link much faster re-plans at once"
    assert job.core.next_deadline() <= 1.6
    cycles = job.core.cycles
    job.tick(1.6)
    assert job.core.cycles == cycles + 1


def test_react_change_zero_waits_for_the_period() -> None:
    job = Job(FAST.replace(react_change=0.0))
    links = [link for link in sorted(RATES) if max(link) <= 4][:3]
    for now, rate in ((1.0, 1.0), (1.1, 1.1), (1.2, 1.2)):  # three links far off their plan, three times
        for src, dst in links:
            job.report(src, dst, rate, now)
    assert job.core.cadence.reason() is Reason.PERIODIC
    assert job.core.collector.change_at is None
    assert job.core.next_deadline() == 60.0 and job.consistency.current_version == 0


def test_without_awareness_only_a_member_down_replans() -> None:
    job = Job(FAST.replace(update_time=0.1, enable_awareness=False), nodes=(1, 2, 3))
    job.report(1, 2, 1.0, now=0.05)
    for now in (0.1, 0.25, 0.4):
        job.tick(now)
    assert job.core.cycles == 3 and job.consistency.current_version == 0 and len(job.plans) == 1
    job.alive = (1, 2)
    job.core.member_down()
    assert job.core.next_deadline() <= 0.4, "at once"
    job.tick(0.4)
    assert job.published[-1] == (1, Reason.MEMBERSHIP.value)
    assert set(job.current.nodes) == {1, 2}
    assert job.plans[-1].rates == job.planner.planned_rates, "without awareness the plan's own rates"


def test_a_member_that_died_unsignalled_is_planned_out_at_the_next_cycle() -> None:
    """A death recorded while the job was starting (its signal dropped) is derived from the policy."""
    job = Job(FAST.replace(enable_awareness=False, update_time=0.05))
    job.core.start_timer(0.0)
    job.alive = (1, 2, 3)
    job.tick(0.05)
    assert job.published[-1] == (1, Reason.MEMBERSHIP.value) and set(job.current.nodes) == {1, 2, 3}


def test_no_cycle_plans_before_the_membership_is_complete_or_with_one_node_left() -> None:
    job = Job(FAST.replace(update_time=0.1))
    assert job.core.timer(0.1, alive=job.alive, complete=False) == []
    assert job.core.cycles == 1
    job.alive = (1,)
    job.core.member_down()
    job.tick(0.1)
    assert job.logs[-1] == "fewer than two live nodes ([1]): no job left to plan for"
    assert job.consistency.current_version == 0


def test_a_plan_not_replan_gain_faster_is_not_published() -> None:
    rates = scenario.load("internet2-9").rates()
    nodes = sorted({a for a, _ in rates})
    config = FAST.replace(update_rate=0.2, num_root_servers=0)
    job = Job(config.replace(replan_gain=0.0), rates=rates, nodes=nodes)
    # Some link 30 % faster (past UPDATE_RATE) gives a different plan that is not 10 % faster: noise.
    first = job.current
    for link in sorted(rates):
        nudged = {**rates, link: rates[link] * 1.3}
        fresh = Planner(topology="fapt", num_roots=0, update_rate=0.2, relative_change=LinkCollector.relative_change)
        fresh.first(rates, nodes)
        candidate = fresh.replan(nudged, nodes, first)
        if candidate is not None:
            gain = 1 - predict(candidate, nudged, 1.0).bulk_s / predict(first, nudged, 1.0).bulk_s
            if 0 <= gain < 0.1:
                break
    else:
        pytest.fail("no link whose change re-plans to a policy less than 10 % faster")
    keeping = Job(config.replace(replan_gain=0.1), rates=rates, nodes=nodes)
    keeping.run([keeping.core.plan(nudged, nodes, force=False, reason="periodic update")])
    assert keeping.published == [(0, "first plan")]
    assert keeping.planner.planned_rates == rates, "the reference stays the plan in force"
    # The busiest link of the first plan down to a fifth: the new plan is far faster at those rates.
    busiest = predict(keeping.current, rates, 1.0).bottleneck
    assert busiest is not None
    keeping.run([keeping.core.plan({**rates, busiest: rates[busiest] / 5}, nodes, force=False,
                                   reason="periodic update")])
    assert keeping.published[-1] == (1, "periodic update")


def test_a_plan_before_the_first_policy_is_refused() -> None:
    consistency = Consistency()
    planner = Planner(topology="fapt", num_roots=0, update_rate=0.0, relative_change=LinkCollector.relative_change)
    core = Replanner(FAST, RATES, (1, 2, 3, 4), planner=planner, consistency=consistency, now=0.0)
    with pytest.raises(PlanningError, match="no first policy yet"):
        core.plan(RATES, (1, 2, 3, 4), force=True, reason="override")


@pytest.mark.parametrize("aux", [True, False])
def test_beliefs_pushed_carry_moves_for_the_newest_bound_iterations_trees(aux: bool) -> None:
    """Iteration 0 is bound to version 0 when link 1-2 collapses: version 1's rates are pushed, with
    moves for version 0's trees that take 1-2's chunks round it (auxiliary paths on only)."""
    job = Job(FAST.replace(enable_aux_path=aux))
    zero = job.current
    job.consistency.request(0, -1)
    slow = {**RATES, (1, 2): 1.0, (2, 1): 1.0}
    job.override(slow)
    assert job.published[-1] == (1, "override")
    if not aux:
        assert job.pushed == []
        return
    (one,) = job.pushed
    assert one.version == 1 and one.rates == slow and one.amends == 0
    assert set(one.offload) <= zero.tree_links() and {(1, 2), (2, 1)} & set(one.offload)
    for link, moves in one.offload.items():
        assert {path for path, _ in moves} <= set(zero.aux_paths[link][1:])
        assert all({(1, 2), (2, 1)}.isdisjoint(itertools.pairwise(p)) for p, _ in moves)
    assert any("re-planned the moves of version 0, bound to iteration 0" in line for line in job.logs)
    # Iterations 1 and 2 bound to version 1, then a new version: moves for version 1's trees, the
    # newest bound iteration's, not version 0's.
    job.consistency.request(1, 0)
    job.consistency.request(2, 1)
    job.override({**slow, (3, 4): 1.0, (4, 3): 1.0})
    two = job.pushed[-1]
    assert two.version == 2 and two.amends == 1
    assert two.offload and set(two.offload) <= job.policy(1).tree_links()
    # Before any iteration is bound nobody runs an older policy: rates alone.
    fresh = Job(FAST.replace(enable_aux_path=True))
    fresh.override(slow)
    assert fresh.pushed == [control.LinkBeliefs(1, slow)]


def test_beliefs_without_moves_when_the_bound_policy_names_a_dead_member() -> None:
    job = Job(FAST.replace(enable_aux_path=True))
    job.consistency.request(0, -1)
    job.alive = (1, 2, 3)
    job.override(RATES, reason="node down")
    assert job.pushed[-1].amends == -1 and job.pushed[-1].version == 1 and not job.pushed[-1].offload


def test_the_core_logs_through_actions_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        job = Job(FAST.replace(react_change=0.3))
        job.report(1, 2, 50.0, now=1.0)
    assert job.logs == ["link 1->2 measured 50.0 Mbit/s (4 samples, warm)"]
    assert [r for r in caplog.records if r.name.startswith("scheduler.replan")] == []
