"""Policy formulation: Algorithm 2 + 3 (netstorm.planning.plan) over the live nodes' link rates.

The first decision picks the roots (top-N quality scores); every later plan passes them back as
``roots=`` so they never move (paper Algorithm 1), minus any root that has died. A re-plan is skipped
when the rates changed by no more than UPDATE_RATE since the last plan (0 refreshes every time), and a
plan whose trees, shares and paths equal the current policy's is not worth a new version; nor is one
that, at the very rates it was made from, the fluid model does not predict at least REPLAN_GAIN faster
than the current policy: reports carry noise, and a plan fitted to it is no better on the real links,
while every new version moves chunks onto links whose queues and rates nobody has seen yet.
Plans are pure CPU work: the service runs them in a thread so heartbeats never stall.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from netstorm.config import Config
from netstorm.errors import NetStormError
from netstorm.planning.plan import plan
from netstorm.planning.predict import busiest_link_s
from netstorm.policy import Policy
from netstorm.scenario import Rates
from netstorm.topologies import TOPOLOGIES
from scheduler.collector import LinkCollector

log = logging.getLogger(__name__)


class PlanningError(NetStormError):
    """No policy can be planned (e.g. the live nodes' overlay is disconnected)."""


def restrict(rates: Rates, nodes: Collection[int]) -> Rates:
    """The directed links between live nodes only."""
    alive = set(nodes)
    return {(a, b): r for (a, b), r in rates.items() if a in alive and b in alive}


class Planner:
    def __init__(self, *, topology: str, num_roots: int, update_rate: float,
                 relative_change: Callable[[Rates, Rates], float], packing: bool = True,
                 replan_gain: float = 0.0, offload: bool = False, fallback: bool = True) -> None:
        self.topology = topology
        self.fallback = fallback
        """A multi-root plan predicted slower than a simpler one falls back to it (PLAN_FALLBACK)."""
        self.packing = packing
        """LP tree packing for multi-root FAPT (TREE_PACKING); false plans with the paper's Algorithm 2."""
        self.offload = offload
        """Plan the auxiliary paths' share of bottleneck tree links (only with auxiliary paths on)."""
        self.num_roots = 1 if TOPOLOGIES.get_entry(topology).single_root else num_roots
        self.update_rate = update_rate
        self.replan_gain = replan_gain
        self._relative_change = relative_change
        self.roots: tuple[int, ...] | None = None
        self.planned_rates: Rates | None = None
        """The rates the latest policy was planned from."""

    @classmethod
    def from_config(cls, config: Config, *, topology: str = "fapt", num_roots: int | None = None) -> Planner:
        """The planner a scheduler runs with ``config``: TREE_PACKING, UPDATE_RATE, REPLAN_GAIN, and
        planned offload only with auxiliary paths and PLANNED_OFFLOAD on (``num_roots`` None: the
        config's NUM_ROOT_SERVERS)."""
        return cls(topology=topology, num_roots=config.num_root_servers if num_roots is None else num_roots,
                   update_rate=config.update_rate, relative_change=LinkCollector.relative_change,
                   packing=config.tree_packing, replan_gain=config.replan_gain,
                   offload=config.enable_aux_path and config.planned_offload, fallback=config.plan_fallback)

    def first(self, rates: Rates, nodes: Collection[int]) -> Policy:
        """The first decision: choose the roots and plan; the roots are fixed from now on."""
        policy = self._plan(restrict(rates, nodes), roots=None)
        self.roots = tuple(policy.roots)
        self.planned_rates = dict(rates)
        log.info("first policy: topology %s, roots %s", self.topology, list(self.roots))
        return policy

    def replan(self, rates: Rates, nodes: Collection[int], current: Policy, *, force: bool = False) -> Policy | None:
        """A new policy from ``rates`` over ``nodes``, or None when nothing changed enough."""
        if self.roots is None or self.planned_rates is None:
            raise PlanningError("replan before the first decision")
        alive = set(nodes)
        membership_changed = not alive.issuperset(self._nodes_of(current))
        if not (force or membership_changed):
            change = self._relative_change(restrict(self.planned_rates, alive), restrict(rates, alive))
            if self.update_rate > 0 and change <= self.update_rate:
                log.debug("rates changed by %.3f <= UPDATE_RATE %.3f: keep policy %d", change, self.update_rate,
                          current.version)
                return None
        roots = tuple(r for r in self.roots if r in alive)
        live_rates = restrict(rates, alive)
        policy = self._plan(live_rates, roots=roots or None)
        if not roots:
            self.roots = tuple(policy.roots)
            log.warning("every root died: new roots %s", list(self.roots))
        if not (force or membership_changed) and self.replan_gain > 0:
            kept_s = busiest_link_s(current, live_rates)
            new_s = busiest_link_s(policy, live_rates)
            if new_s > kept_s * (1 - self.replan_gain):
                log.debug("new plan only %.1f %% faster than policy %d at the measured rates "
                          "(REPLAN_GAIN %.0f %%): keep it", 100 * (1 - new_s / kept_s), current.version,
                          100 * self.replan_gain)
                return None
        self.planned_rates = dict(rates)
        if not force and not membership_changed and policy.with_version(current.version) == current:
            return None
        return policy

    def _plan(self, rates: Rates, roots: tuple[int, ...] | None) -> Policy:
        """Rooted topologies keep their root set; baselines keep their hub (the root of the first plan)."""
        policy = self._plan_at(rates, roots)
        if policy.fallback:
            log.info("%s plan: %s", self.topology, policy.fallback)
        return policy

    def _plan_at(self, rates: Rates, roots: tuple[int, ...] | None) -> Policy:
        try:
            if roots is None:
                return plan(rates, topology=self.topology, num_roots=self.num_roots, packing=self.packing,
                            offload=self.offload, fallback=self.fallback)
            if TOPOLOGIES[self.topology].rooted:  # roots from quality scores stay; baselines keep their hub
                return plan(rates, topology=self.topology, num_roots=self.num_roots, roots=roots,
                            packing=self.packing, offload=self.offload, fallback=self.fallback)
            return plan(rates, topology=self.topology, hub=roots[0])
        except NetStormError as exc:
            raise PlanningError(f"cannot plan a {self.topology} policy: {exc}") from exc

    @staticmethod
    def _nodes_of(policy: Policy) -> set[int]:
        return set(policy.nodes)
