"""Local search over one tree per root: the packing's cut to one tree per root, improved tree by tree.

``pack_trees`` finds the best mix of any number of spanning trees; the runtime has one tree per root,
and cutting the mix down to that many trees can leave the busiest link well above the optimum (on a
symmetric circulant, although a rotation of one well-chosen tree reaches the optimum exactly).
This search takes each root in turn, solves the LP over the other roots' trees, and offers that root
Prim trees grown from it under the link duals of that LP (the weights the LP's own pricing step uses),
no node more than 0 or 1 hop below its BFS depth, so a chunk's trip up and down does not grow (the
unbounded minimum spanning tree lightened the busiest link as much but deepened the trees). A swap
stands when the busiest link gets lighter, or stays as light and the root's tree gets faster.

Two starts are searched, the packing's trees and every root's shallowest tree, and the better end
(busiest link, then the slowest tree's delay) is kept. Everything is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np

from netstorm.planning.packing import EdgeSet, PackingGraph, assign_roots, pack_trees, rounded_shares, solve_with_duals
from netstorm.planning.rategraph import RateGraph
from netstorm.tree import Tree

__all__ = ["MAX_SEARCH_WORK", "SWEEPS", "Overlay", "Search", "pack_for_roots", "refine_roots"]

SWEEPS = 8
"""Passes over all roots before the search stops (it stops earlier once a pass changes nothing)."""
MAX_SEARCH_WORK = 2000
"""Largest overlay the search runs on, as roots x links: each LP solve costs about that much, and a sweep
solves a few per root, so the search grows with roots x links; on large overlays the packing needs
fewer trees than roots anyway, so the cut is already optimal there (``results/DECISIONS.md``)."""
RTOL = 1e-9
SLACKS = (0, 1)
"""Depth bounds tried for the Prim candidates: each node at most this many hops below its BFS depth."""


class Overlay:
    """What the search asks of a PackingGraph again and again, kept in plain lists: adjacency, BFS
    depths per root and tree delays (memoised: a sweep re-reads the same trees many times)."""

    def __init__(self, graph: PackingGraph) -> None:
        self.graph = graph
        self.adjacency: list[list[tuple[int, int]]] = [[] for _ in range(graph.n)]
        for e, (a, b) in enumerate(zip(graph.u.tolist(), graph.v.tolist(), strict=True)):
            self.adjacency[a].append((b, e))
            self.adjacency[b].append((a, e))
        self.speed = (graph.up + graph.down).tolist()
        self._up, self._down = graph.up.tolist(), graph.down.tolist()
        self._u = graph.u.tolist()
        self._hops: dict[int, list[int]] = {}
        self._delays: dict[tuple[int, EdgeSet], float] = {}

    def hops(self, root: int) -> list[int]:
        """BFS depth of every node from ``root``."""
        if root not in self._hops:
            depth = [-1] * self.graph.n
            depth[root] = 0
            frontier = [root]
            while frontier:
                nxt = []
                for x in frontier:
                    for y, _ in self.adjacency[x]:
                        if depth[y] < 0:
                            depth[y] = depth[x] + 1
                            nxt.append(y)
                frontier = nxt
            self._hops[root] = depth
        return self._hops[root]

    def delay(self, root: int, edges: EdgeSet) -> float:
        """Seconds per Mbit of ``edges`` rooted at ``root`` up and back down: Theorem 1's push delay
        plus the results' delay, one chunk's trip through the pipeline."""
        key = (root, edges)
        if key not in self._delays:
            members = set(edges)
            up_cost, down_cost = {root: 0.0}, {root: 0.0}
            frontier = [root]
            while frontier:
                nxt = []
                for x in frontier:
                    for y, e in self.adjacency[x]:
                        if e in members and y not in up_cost:
                            towards_root = self._up[e] if self._u[e] == y else self._down[e]
                            away = self._down[e] if self._u[e] == y else self._up[e]
                            up_cost[y] = up_cost[x] + towards_root
                            down_cost[y] = down_cost[x] + away
                            nxt.append(y)
                frontier = nxt
            self._delays[key] = max(up_cost.values()) + max(down_cost.values())
        return self._delays[key]

    def shallow_tree(self, root: int, weight: np.ndarray, slack: int = 0) -> EdgeSet:
        """Prim's tree from node index ``root`` under ``weight``, no node more than ``slack`` hops deeper
        than its BFS depth; ties go to the shallower join, then the faster edge, then the node ids.

        Always spanning: a node's BFS predecessor sits at most ``slack`` below its own BFS depth, so it
        is a parent the bound admits.
        """
        bound = [h + slack for h in self.hops(root)]
        cost = np.round(weight, 12).tolist()
        depth = {root: 0}
        chosen: list[int] = []
        heap: list[tuple[float, int, float, int, int, int]] = []

        def offer(x: int) -> None:
            for y, e in self.adjacency[x]:
                if y not in depth and depth[x] + 1 <= bound[y]:
                    heapq.heappush(heap, (cost[e], depth[x] + 1, self.speed[e], x, y, e))

        offer(root)
        while heap and len(depth) < self.graph.n:
            _, d, _, _, y, e = heapq.heappop(heap)
            if y in depth:
                continue
            depth[y] = d
            chosen.append(e)
            offer(y)
        return tuple(sorted(chosen))


class Search:
    """One tree per root (node indices of a PackingGraph) and what the LP makes of them."""

    def __init__(self, overlay: Overlay, roots: Sequence[int], trees: Sequence[EdgeSet], *,
                 solved: Search | None = None) -> None:
        """``solved``: a search over the same trees whose LP answer is taken instead of solving again."""
        self.overlay = overlay
        self.graph = overlay.graph
        self.roots = list(roots)
        self.trees = list(trees)
        self.shares: np.ndarray
        self.t_value: float
        if solved is not None and solved.trees == self.trees:
            self.shares, self.t_value = solved.shares, solved.t_value
        else:
            self.shares, self.t_value, _, _ = solve_with_duals(self.graph, self.trees)

    def delay(self, k: int, edges: EdgeSet | None = None) -> float:
        """Root k's tree (or ``edges`` rooted there): seconds per Mbit up and back down."""
        return self.overlay.delay(self.roots[k], self.trees[k] if edges is None else edges)

    def slowest(self) -> float:
        return max(self.delay(k) for k in range(len(self.roots)))

    def key(self) -> tuple[float, float]:
        return (self.t_value, self.slowest())

    def sweep(self) -> bool:
        """Offer every root its candidates once; whether any swap stood."""
        changed = False
        for k in range(len(self.roots)):
            others = self.trees[:k] + self.trees[k + 1:]
            if not others:
                continue
            _, _, y, _ = solve_with_duals(self.graph, others)
            weight = y[0::2] * self.graph.up + y[1::2] * self.graph.down
            candidates = [self.overlay.shallow_tree(self.roots[k], weight, slack) for slack in SLACKS]
            for candidate in dict.fromkeys(candidates):
                if candidate == self.trees[k]:
                    continue
                trial = [*self.trees[:k], candidate, *self.trees[k + 1:]]
                shares, t_value, _, _ = solve_with_duals(self.graph, trial)
                better = t_value < self.t_value * (1 - RTOL) or (
                    t_value <= self.t_value * (1 + RTOL) and self.delay(k, candidate) < self.delay(k) * (1 - RTOL))
                if better:
                    self.trees, self.shares, self.t_value = trial, shares, t_value
                    changed = True
                    break
        return changed


def refine_roots(start: Search, *, sweeps: int = SWEEPS) -> Search:
    """The better of the searches from ``start``'s trees and from every root's shallowest tree
    (``start`` itself is left as it is)."""
    overlay = start.overlay
    zero = np.zeros(overlay.graph.m)
    shallow = [overlay.shallow_tree(r, zero) for r in start.roots]
    best: Search | None = None
    for search in (Search(overlay, start.roots, start.trees, solved=start), Search(overlay, start.roots, shallow)):
        for _ in range(sweeps):
            if not search.sweep():
                break
        if best is None or _beats(search.key(), best.key()):
            best = search
    assert best is not None
    return best


def pack_for_roots(graph: RateGraph, roots: Sequence[int], seeds: Iterable[Tree] = ()
                   ) -> tuple[dict[int, Tree], dict[int, float]]:
    """Packed trees and shares for the fixed ``roots``, one tree per root, seeded by ``seeds``.

    The packing cut to one tree per root (``pack_trees``, ``assign_roots``) stands unless the local
    search beats it (on overlays up to ``MAX_SEARCH_WORK``). The search's shares are the LP's for its
    trees; roots left with the same tree split that tree's share equally (the loads are the same), and
    a root whose own tree the LP does not need aggregates nothing.
    """
    packing_graph = PackingGraph.from_graph(graph)
    seed_sets = [s for s in (packing_graph.edge_set(t) for t in seeds) if s is not None]
    packing = pack_trees(packing_graph, seeds=seed_sets, max_trees=len(roots))
    trees, share = assign_roots(packing_graph, packing, roots)
    if len(roots) * packing_graph.m > MAX_SEARCH_WORK:
        return trees, share
    index = [packing_graph.position[r] for r in roots]
    assigned = Search(Overlay(packing_graph), index, [_edges(packing_graph, trees[r]) for r in roots])
    search = refine_roots(assigned)
    if not _beats(search.key(), assigned.key()):
        return trees, share
    shares = rounded_shares(search.shares)
    holders: dict[EdgeSet, list[int]] = {}
    for k, edges in enumerate(search.trees):
        holders.setdefault(edges, []).append(k)
    split = np.zeros(len(roots))
    for ks in holders.values():
        split[ks] = float(shares[ks].sum()) / len(ks)
    refined = {r: packing_graph.rooted(search.trees[k], r) for k, r in enumerate(roots)}
    return refined, {r: float(split[k]) for k, r in enumerate(roots)}


def _beats(key: tuple[float, float], other: tuple[float, float]) -> bool:
    """A lighter busiest link, or one as light and a faster slowest tree."""
    return key[0] < other[0] * (1 - RTOL) or (key[0] <= other[0] * (1 + RTOL) and key[1] < other[1] * (1 - RTOL))


def _edges(graph: PackingGraph, tree: Tree) -> EdgeSet:
    edges = graph.edge_set(tree)
    assert edges is not None, "packed trees use links present both ways"
    return edges
