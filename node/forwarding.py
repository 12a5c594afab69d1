"""Auxiliary multipath forwarding, sender side: which path a chunk takes over a tree edge.

Per tree edge (this node -> neighbour) and policy version, a ``PathScheduler`` (paper Fig. 7) picks the
primary path or one of the policy's auxiliary paths for (src, dst). Auxiliary chunks carry ``is_aux``
and the full path; nodes on the way forward them by the header (``ChunkCore._forward``), so a path
that is stale for an intermediate node's own policy still arrives.

Links the policy asks to ``explore`` (unmeasured since the network changed, on no tree) get
``EXPLORE_CHUNKS`` chunks per iteration each, sent on auxiliary paths whose first hop they are, the
first ones chosen in the iteration (the lowest chunks leave first, so they have the whole iteration to
arrive). Over an iteration or two their samples make a throughput report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from netstorm.config import Config
from netstorm.policy import Policy
from netstorm.sendsched import LinkView, PathScheduler

log = logging.getLogger("netstorm.node")

Path = tuple[int, ...]

EXPLORE_CHUNKS = 2
"""Chunks per iteration routed through each link the policy asks to explore: a report needs
PROBE_CHUNK_NUM samples spanning PROBE_WINDOW, so two per iteration give one within two or three
iterations, while a link that really is slow delays only two small chunks of each iteration."""


class Forwarding:
    """Path schedulers of one node, keyed by (policy version, destination)."""

    def __init__(self, node_id: int, config: Config) -> None:
        self.node_id = node_id
        self.config = config
        self._schedulers: dict[tuple[int, int], PathScheduler] = {}
        self.aux_chunks = 0
        self.primary_chunks = 0
        self.moved_chunks = 0
        """Chunks queued on a tree edge and moved to an auxiliary path later (``PathScheduler.reroute``)."""
        self.explored_chunks = 0
        """Chunks sent on an auxiliary path to measure a link the policy asked to explore."""
        self._explore_iteration = -1
        self._explored: dict[int, int] = {}
        """First hop -> chunks sent through it in ``_explore_iteration``."""
        self._beliefs: tuple[int, dict[tuple[int, int], float]] = (-1, {})
        """(policy version, link -> bytes/s it was planned from): the newest the scheduler pushed."""
        self._amendment: tuple[int, Mapping[tuple[int, int], tuple[tuple[Path, float], ...]]] = (-1, {})
        """(older policy version, its re-planned offload): the newest the scheduler pushed."""

    def _scheduler(self, policy: Policy, dst: int) -> PathScheduler:
        key = (policy.version, dst)
        scheduler = self._schedulers.get(key)
        if scheduler is None:
            paths = tuple(policy.aux_paths.get((self.node_id, dst), ()))
            primary: Path = (self.node_id, dst)
            aux = [p for p in paths[1:] if len(p) >= 2 and p[0] == self.node_id and p[-1] == dst
                   and len(set(p)) == len(p)]
            planned = {pair: mbit * 1e6 / 8 for pair, mbit in policy.rates.items()}
            scheduler = PathScheduler(primary, aux, busy_bound=self.config.primary_busy_bound,
                                      aux_queue_length=self.config.auxiliary_queue_length,
                                      enabled=self.config.enable_aux_path and bool(aux),
                                      planned_bps=planned, slowdown=self.config.aux_slowdown,
                                      reroute_below=self.config.aux_reroute,
                                      offload=policy.offload.get((self.node_id, dst), ()))
            if self._beliefs[0] > policy.version:
                scheduler.believe(self._beliefs[1])
            if self._amendment[0] == policy.version and scheduler.enabled:
                scheduler.amend(self._amendment[1].get((self.node_id, dst), ()))
            # Schedulers of older versions keep their in-flight counts until their chunks left.
            self._schedulers[key] = scheduler
        return scheduler

    def believe(self, version: int, rates_mbit: Mapping[tuple[int, int], float], amends: int = -1,
                offload: Mapping[tuple[int, int], tuple[tuple[Path, float], ...]] | None = None
                ) -> list[PathScheduler]:
        """The scheduler published policy ``version``, planned from ``rates_mbit``: iterations bound to
        older versions keep their trees, and their path schedulers weigh detours by these rates. ``offload``
        re-plans the moves of version ``amends`` for them. Returns the schedulers whose moves changed
        (their queued chunks can follow the new moves)."""
        if version <= self._beliefs[0]:
            return []
        self._beliefs = (version, {pair: mbit * 1e6 / 8 for pair, mbit in rates_mbit.items()})
        if amends >= 0:
            self._amendment = (amends, dict(offload or {}))
        blocked = 0
        amended: list[PathScheduler] = []
        for (policy_version, dst), scheduler in self._schedulers.items():
            if policy_version < version:
                scheduler.believe(self._beliefs[1])
            if policy_version == amends and scheduler.enabled:
                scheduler.amend(self._amendment[1].get((self.node_id, dst), ()))
                amended.append(scheduler)
            if policy_version < version:
                blocked += len(scheduler.blocked)
        log.info("node %d: policy version %d published; %d auxiliary paths of older versions now avoided "
                 "(a later hop behind its plan); moves of version %s re-planned on %d tree edges", self.node_id,
                 version, blocked, amends if amends >= 0 else "-", sum(1 for s in amended if s.offload))
        return amended

    def choose(self, policy: Policy, dst: int, view: Callable[[int], LinkView] | None = None,
               size: int = 0, iteration: int = 0) -> tuple[Path, PathScheduler]:
        """The path for the next chunk (``size`` bytes) of ``iteration`` over the tree edge to ``dst``;
        counts it as in flight. ``view(neighbour)``: this node's link to that neighbour now."""
        scheduler = self._scheduler(policy, dst)
        path = self._explore(policy, scheduler, iteration) or scheduler.choose(view, size)
        if len(path) > 2:
            self.aux_chunks += 1
        else:
            self.primary_chunks += 1
        return path, scheduler

    def _explore(self, policy: Policy, scheduler: PathScheduler, iteration: int) -> Path | None:
        if not policy.explore or iteration < self._explore_iteration:
            return None
        if iteration > self._explore_iteration:
            self._explore_iteration, self._explored = iteration, {}
        hops = {dst for src, dst in policy.explore
                if src == self.node_id and self._explored.get(dst, 0) < EXPLORE_CHUNKS}
        path = scheduler.explore(hops) if hops else None
        if path is not None:
            self._explored[path[1]] = self._explored.get(path[1], 0) + 1
            self.explored_chunks += 1
        return path

    def forget_before(self, version: int) -> None:
        """Drop schedulers of policy versions older than ``version`` (their chunks are gone)."""
        for key in [k for k in self._schedulers if k[0] < version]:
            del self._schedulers[key]
