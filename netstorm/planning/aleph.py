"""ALEPH's M-WCHA: pick aggregator workers and their clusters from each worker's bandwidth and compute.

See docs/ARCHITECTURE.md, *Planning the tier inside a DC*."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from netstorm.lan_scenario import LanSpec
from netstorm.planning.lanmodel import GATEWAY, DcPlan, Node, make_plan

DEFAULT_TRIALS = 16
MAX_ROUNDS = 64
"""Rounds one run may take (LRG needs O(log n · log Δ) w.h.p.; a safety cap)."""


@dataclass(frozen=True)
class Clustering:
    clusters: dict[int, tuple[int, ...]]
    """Aggregator -> its members (the aggregator not included); only aggregators with members."""
    direct: tuple[int, ...]
    """Workers that send straight to the gateway."""
    rounds: int

    @property
    def size(self) -> int:
        """HA's objective: clusters, a worker sending alone counting as one."""
        return len(self.clusters) + len(self.direct)


def neighbours(lan: LanSpec) -> dict[int, set[int]]:
    """Closed neighbourhoods N(w): the workers one switch away (same rack, or all without racks)."""
    out: dict[int, set[int]] = {}
    for w in lan.workers:
        out[w.index] = {v.index for v in lan.workers if not lan.racks or v.rack == w.rack}
    return out


def capacities(lan: LanSpec) -> dict[int, int]:
    """g_w = floor(min(B_w/b - 1, C_w/c)) with b = c = min_w B_w."""
    bw = {w.index: min(w.up_gbit, w.down_gbit) for w in lan.workers}
    b = min(bw.values())
    out = {}
    for w in lan.workers:
        by_port = bw[w.index] / b - 1
        by_cpu = math.inf if w.agg_gbit is None else w.agg_gbit / b
        out[w.index] = max(0, math.floor(min(by_port, by_cpu) + 1e-9))
    return out


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def mwcha(g: Mapping[int, int], nbr: Mapping[int, set[int]], rng: random.Random) -> Clustering:
    """One run of Algorithm 1 with the capacity cap and the probability clamp."""
    uncovered = set(g)
    clusters: dict[int, list[int]] = {}
    rounds = 0
    while uncovered and rounds < MAX_ROUNDS:
        rounds += 1
        gbar = {w: min(g[w], len((nbr[w] & uncovered) - {w})) for w in uncovered}
        ghat = {w: _pow2(gbar[w]) for w in uncovered}
        two_hop = {w: set().union(*(nbr[v] for v in nbr[w])) & uncovered for w in uncovered}
        cands = sorted(w for w in uncovered if all(ghat[w] >= ghat[v] for v in two_hop[w]))
        alpha = {w: (gbar[w] / len((nbr[w] & uncovered) - {w}) if gbar[w] else 0.0) for w in cands}
        beta = {v: sum(alpha[w] for w in cands if v in nbr[w]) for v in uncovered - set(cands)}
        selected = 0
        for w in cands:
            if w not in uncovered or gbar[w] == 0:
                continue
            support = [beta[v] for v in (nbr[w] & uncovered) - {w} if v in beta]
            m = statistics.median(support) if support else 1.0
            if rng.random() >= min(1.0, 1.0 / m if m > 0 else 1.0):
                continue
            uncovered.discard(w)
            members: list[int] = []
            cap = min(g[w], gbar[w])
            for v in sorted((nbr[w] & uncovered) - {w}):
                if len(members) >= cap:
                    break  # the hard cap: |V_w| - 1 <= ḡ_w, not only in expectation
                if rng.random() < alpha[w]:
                    members.append(v)
            uncovered.difference_update(members)
            if members:
                clusters[w] = members
                selected += 1
            else:
                uncovered.add(w)  # alone it is no aggregator; it may still be picked later
        if selected == 0:
            break  # the paper's stopping rule: the rest send straight to the PS
    return Clustering({a: tuple(m) for a, m in sorted(clusters.items())}, tuple(sorted(uncovered)), rounds)


def optimum(g: Mapping[int, int], nbr: Mapping[int, set[int]]) -> int:
    """The exact HA optimum (fewest clusters) by enumerating aggregator sets; small DCs only."""
    workers = sorted(g)
    useful = [w for w in workers if g[w] > 0]
    best = len(workers)
    for k in range(1, len(useful) + 1):
        if k >= best:
            break
        for aggs in itertools.combinations(useful, k):
            rest = [w for w in workers if w not in aggs]
            best = min(best, k + len(rest) - _max_cover(rest, aggs, g, nbr))
    return best


def _max_cover(rest: list[int], aggs: tuple[int, ...], g: Mapping[int, int], nbr: Mapping[int, set[int]]) -> int:
    """Most of ``rest`` that can join aggregators ``aggs`` (each at most g, neighbours only)."""
    load = {a: 0 for a in aggs}
    owner: dict[int, int] = {}

    def augment(v: int, seen: set[int]) -> bool:
        for a in aggs:
            if v not in nbr[a] or a in seen:
                continue
            seen.add(a)
            if load[a] < g[a]:
                load[a] += 1
                owner[v] = a
                return True
            for u in [u for u, o in owner.items() if o == a]:
                if augment(u, seen):
                    owner[v] = a
                    return True
        return False

    return sum(1 for v in rest if augment(v, set()))


def harmonic_bound(g: Mapping[int, int], nbr: Mapping[int, set[int]]) -> float:
    """Theorem 7's bound factor 8·H_Δ, Δ = max(g_w, one-hop degree) + 1."""
    delta = max(max(g.values()), max(len(n) - 1 for n in nbr.values())) + 1
    return 8 * sum(1 / k for k in range(1, delta + 1))


def plan(lan: LanSpec, *, seed: int = 0, trials: int = DEFAULT_TRIALS) -> DcPlan:
    """The best of ``trials`` M-WCHA runs (fewest clusters, then best predicted throughput)."""
    g = capacities(lan)
    nbr = neighbours(lan)
    rng = random.Random(seed)
    best: tuple[tuple[int, float], DcPlan] | None = None
    for _ in range(max(1, trials)):
        c = mwcha(g, nbr, rng)
        parent: dict[Node, Node] = {w: GATEWAY for w in g}
        for agg, members in c.clusters.items():
            for m in members:
                parent[m] = agg
        notes = [] if lan.racks else ["no racks: every worker is one switch from every other"]
        p = make_plan("aleph", lan, parent, notes,
                      {"clusters": c.size, "rounds": c.rounds, "capacities": {str(w): g[w] for w in sorted(g)}})
        key = (c.size, -p.prediction.gbit)
        if best is None or key < best[0]:
            best = (key, p)
    assert best is not None
    return best[1]
