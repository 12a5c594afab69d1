"""The scheduler's re-plan rules as a sans-I/O core: what link reports mean, when to re-plan, and what a
new policy's publication carries.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Collection, Mapping
from typing import Any

from netstorm import control
from netstorm.config import Config
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from netstorm.scenario import Rates
from scheduler.cadence import Cadence, Reason, shifted, slows
from scheduler.collector import LinkCollector
from scheduler.consistency import Consistency
from scheduler.planner import Planner, PlanningError, restrict

Moves = Mapping[tuple[int, int], tuple[tuple[tuple[int, ...], float], ...]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Plan a policy from ``rates`` over ``nodes`` (``Planner.first`` when ``current`` is None, else
    ``Planner.replan``) and hand the result to ``planned``."""

    rates: Rates
    nodes: tuple[int, ...]
    current: Policy | None
    force: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Publish:
    """Make ``policy`` (already carrying its new version) current for every iteration not yet bound."""

    policy: Policy
    reason: str


@dataclasses.dataclass(frozen=True)
class PlanMoves:
    """Plan moves for ``old``'s trees and shares at ``beliefs.rates`` (``plan_offload`` with fixed shares)
    and hand them to ``moves_planned``; ``old`` is bound to iteration ``iteration``."""

    beliefs: control.LinkBeliefs
    old: Policy
    iteration: int


@dataclasses.dataclass(frozen=True)
class PushBeliefs:
    """Send ``beliefs`` to every node."""

    beliefs: control.LinkBeliefs


@dataclasses.dataclass(frozen=True)
class Log:
    level: int
    message: str
    args: tuple[object, ...] = ()


Action = Plan | Publish | PlanMoves | PushBeliefs | Log


class Replanner:
    """The re-plan rules of one job; owns the link beliefs (``collector``) and the ``cadence``."""

    def __init__(self, config: Config, rates: Rates, nodes: Collection[int], *, planner: Planner,
                 consistency: Consistency, now: float) -> None:
        self.config = config
        self.initial_rates = dict(rates)
        self.planner = planner
        """Its ``planned_rates`` are what the rules compare reports with; plans run it in a worker."""
        self.consistency = consistency
        """Read only: the current policy and the bindings (the shell publishes)."""
        # with joiners allowed, any DC of the scenario may come: its links are believed from the start
        believed = rates if config.allow_joiners else restrict(rates, nodes)
        self.collector = self._collector(believed, now)
        self.cadence = Cadence(update_time=config.update_time, react_interval=config.react_interval, now=now)
        self.cycles = 0
        """Re-plan cycles started so far (tests wait on it instead of sleeping)."""
        self._ignored_links: set[tuple[int, int]] = set()
        self.probed_links = 0
        """Links the first probe round measured (the first plan's reason says so)."""

    def _collector(self, believed: Rates, now: float) -> LinkCollector:
        config = self.config
        return LinkCollector(believed, now=now, stale_after=config.stale_after if config.stale_decay else math.inf,
                             half_life=config.stale_half_life, recent=config.belief_reports)

    def probed(self, rates: Rates, now: float) -> None:
        """The first probe round measured ``rates`` (before any policy): the first plan starts from them,
        and so do the beliefs, which the passive reports then follow."""
        self.initial_rates.update(rates)
        self.probed_links = len(rates)
        believed = self.collector.estimate(now)
        self.collector = self._collector({link: rates.get(link, rate) for link, rate in believed.items()}, now)

    # --- timing ----------------------------------------------------------------------------------

    def start_timer(self, now: float) -> None:
        """The shell's timer starts: periods count from ``now``, and signals before it are dropped."""
        self.cadence = Cadence(update_time=self.config.update_time, react_interval=self.config.react_interval,
                               now=now)

    def next_deadline(self) -> float:
        """When ``timer`` has a re-plan cycle to start (may be in the past: at once)."""
        return self.cadence.due()

    # --- events ----------------------------------------------------------------------------------

    def member_down(self) -> None:
        """A member was declared dead: re-plan at once."""
        self.cadence.member_down()

    def link_report(self, report: LinkReport, now: float) -> list[Action]:
        """A node's report of one directed link (the shell checked the node is one of its ends)."""
        link = (report.src, report.dst)
        try:
            explored = self._exploring(*link)
            self.collector.add(report, now)
        except ValueError as exc:
            # e.g. a STAR/BKT tree edge between non-adjacent DCs measures a route, not an overlay link
            if link in self._ignored_links:
                return []
            self._ignored_links.add(link)
            return [Log(logging.WARNING, "link reports %d->%d ignored (said once): %s", (*link, exc))]
        out: list[Action] = [Log(logging.DEBUG, "link %d->%d measured %.1f Mbit/s (%d samples, %s)",
                                 (*link, report.mbit_s, report.samples, "warm" if report.warm else "cold"))]
        config = self.config
        planned = self.planner.planned_rates
        if config.enable_awareness and planned is not None and config.react_change > 0:
            at = self.collector.change_seen(planned, config.react_change, now=now)
            if at is not None and self.collector.note_change(at, change_gap=config.update_time):
                out.append(Log(logging.INFO, "network change %.2f s ago, seen on several links: reports before it "
                                             "stop counting", (now - at,)))
                self.cadence.change()  # the plans since were made from the old reports
        believed = self.collector.state(*link).mbit_s
        current = self.consistency.current_version
        if (explored and planned is not None and link in planned and self.cadence.reason() is Reason.PERIODIC
                and believed > planned[link] * (1 + config.react_change)):
            out.append(Log(logging.DEBUG, "explored link %d->%d measured at %.1f Mbit/s, planned at %.1f: "
                                          "re-planning early", (*link, believed, planned[link])))
            self.cadence.shift()
            return out
        if (config.enable_awareness and planned is not None and current is not None
                and self.cadence.reason() is Reason.PERIODIC  # else one is due early
                and shifted(planned, link, believed, config.react_change)
                and self.collector.moved(link, planned[link], config.react_change)):
            policy: Any = self.consistency.policy(current)
            if slows(policy, planned, self.collector.estimate(now), config.react_change):
                out.append(Log(logging.DEBUG, "link %d->%d now believed at %.1f Mbit/s, planned at %.1f, slows "
                                              "policy %d: re-planning early",
                               (*link, believed, planned[link], current)))
                self.cadence.shift()
        return out

    def timer(self, now: float, *, alive: Collection[int], complete: bool) -> list[Action]:
        """The timer fired: start a re-plan cycle if one is due (``next_deadline``), over the ``alive``
        members, once the membership is ``complete``."""
        if now < self.cadence.due():
            return []
        reason = self.cadence.start(now)
        self.cycles += 1
        if not complete:
            return []
        # Derived, not only signalled: a member that died while the job was starting signalled before
        # there was a policy to change, and that signal is gone.
        if reason is not Reason.MEMBERSHIP and self._policy_has_dead_members(alive):
            reason = Reason.MEMBERSHIP
        if reason is not Reason.MEMBERSHIP and not self.config.enable_awareness:
            return []
        if len(alive) < 2:
            return [Log(logging.INFO, "fewer than two live nodes (%s): no job left to plan for", (list(alive),))]
        rates = self.collector.estimate(now) if self.config.enable_awareness \
            else self.planner.planned_rates or self.initial_rates
        return [self.plan(rates, alive, force=False, reason=reason.value)]

    def first_plan(self, nodes: Collection[int]) -> Plan:
        """Every expected node registered: the first policy, from the initial rates."""
        reason = f"first plan, {self.probed_links} link(s) probed" if self.probed_links else "first plan"
        return Plan(self.initial_rates, tuple(nodes), None, force=False, reason=reason)

    def plan(self, rates: Rates, nodes: Collection[int], *, force: bool, reason: str) -> Plan:
        """A re-plan from ``rates`` over ``nodes`` against the current policy (``force``: publish it even
        if it changes little, as an override does)."""
        current_version = self.consistency.current_version
        if current_version is None:
            raise PlanningError("no first policy yet")
        current = self.consistency.policy(current_version)
        assert isinstance(current, Policy)
        return Plan(dict(rates), tuple(nodes), current, force, reason)

    def planned(self, plan: Plan, policy: Policy | None, *, alive: Collection[int]) -> list[Action]:
        """``plan`` came back with ``policy`` (None: the planner keeps the current one)."""
        if policy is None:
            return []
        if plan.current is None:
            return [Publish(policy.with_version(self.consistency.next_version()), plan.reason)]
        published = self._with_explore(policy).with_version(self.consistency.next_version())
        out: list[Action] = [Publish(published, plan.reason)]
        config = self.config
        if config.enable_aux_path and (config.planned_offload or config.aux_slowdown > 0):
            out.append(self._beliefs(published.version, policy.rates, alive))
        return out

    def moves_planned(self, request: PlanMoves, moves: Moves) -> list[Action]:
        """The moves ``request`` asked for came back."""
        beliefs = request.beliefs
        if not moves:
            return [PushBeliefs(beliefs)]
        return [Log(logging.INFO, "policy version %d re-planned the moves of version %d, bound to iteration %d: "
                                  "%d tree links offload onto auxiliary paths",
                    (beliefs.version, request.old.version, request.iteration, len(moves))),
                PushBeliefs(control.LinkBeliefs(beliefs.version, beliefs.rates, amends=request.old.version,
                                                offload=moves))]

    # --- rules -----------------------------------------------------------------------------------

    def _beliefs(self, version: int, rates: Mapping[tuple[int, int], float],
                 alive: Collection[int]) -> PushBeliefs | PlanMoves:
        """What senders of iterations bound before ``version`` should weigh detours by: its planning
        rates, and moves planned for them with the trees and shares of the newest bound iteration's
        policy (that iteration keeps its trees, not the rates they were planned for)."""
        positive = {link: r for link, r in rates.items() if r > 0}
        plain = PushBeliefs(control.LinkBeliefs(version, positive))
        bindings = self.consistency.bindings
        if not bindings or not self.config.planned_offload:
            return plain
        iteration = max(bindings)
        bound = bindings[iteration]
        if bound >= version:
            return plain
        try:
            old: Any = self.consistency.policy(bound)
        except KeyError:
            return plain
        if not isinstance(old, Policy) or not old.aux_paths or set(old.nodes) - set(alive) \
                or any(link not in positive for link in old.tree_links()):
            return plain
        return PlanMoves(plain.beliefs, old, iteration)

    def _exploring(self, src: int, dst: int) -> bool:
        """Whether the current policy asks for link ``src -> dst`` to be explored and it has not been
        measured since (its first report then may show a link the trees should use)."""
        current = self.consistency.current_version
        if current is None or not self.config.enable_awareness:
            return False
        policy: Any = self.consistency.policy(current)
        return (src, dst) in policy.explore and self.collector.unconfirmed(src, dst)

    def _with_explore(self, policy: Policy) -> Policy:
        """``policy`` asking its senders to explore the links no tree uses and nobody measured since the
        network last changed (with auxiliary paths on: they are what carries the exploring chunks)."""
        if not (self.config.enable_aux_path and self.config.enable_awareness and self.config.explore_links):
            return policy
        used = policy.tree_links()
        nodes = set(policy.nodes)
        explore = frozenset(link for link in policy.rates if link not in used and set(link) <= nodes
                            and self.collector.unconfirmed(*link))
        return dataclasses.replace(policy, explore=explore) if explore else policy

    def _policy_has_dead_members(self, alive: Collection[int]) -> bool:
        current = self.consistency.current_version
        if current is None:
            return False
        policy: Any = self.consistency.policy(current)
        return not set(alive).issuperset(policy.nodes)
