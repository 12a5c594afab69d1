"""Local search over one tree per root: the packing's cut to one tree per root, improved tree by tree.

``pack_trees`` finds the best mix of any number of spanning trees; the runtime has one tree per root,
and cutting the mix down to that many trees can leave the busiest link well above the optimum (on a
15-node circulant, 7.6 % above it, although a rotation of one well-chosen tree reaches it exactly).
This search takes each root in turn, solves the LP over the other roots' trees, and offers that root
the trees that would relieve the others' busiest links most: a minimum spanning tree under their
link duals (the LP's own pricing step) and depth-bounded Prim trees grown from the root under the
same weights, which stay shallow so a chunk's trip up and down does not grow. A swap stands when the
busiest link gets lighter, or stays as light and the root's tree gets faster (Theorem-1 delay).

Two starts are searched, the packing's trees and every root's shallowest tree, and the better end
(busiest link, then the slowest tree's delay) is kept. Everything is deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

from netstorm.packing import EdgeSet, PackingGraph, assign_roots, pack_trees, rounded_shares, solve_with_duals
from netstorm.rategraph import RateGraph
from netstorm.tree import Tree

__all__ = ["SWEEPS", "Search", "pack_for_roots", "refine_roots", "shallow_tree"]

SWEEPS = 8
"""Passes over all roots before the search stops (it stops earlier once a pass changes nothing)."""
RTOL = 1e-9
SLACKS = (0, 1)
"""Depth bounds tried for the Prim candidates: each node at most this many hops below its BFS depth."""


class Search:
    """One tree per root (node indices of a PackingGraph) and what the LP makes of them."""

    def __init__(self, graph: PackingGraph, roots: Sequence[int], trees: Sequence[EdgeSet]) -> None:
        self.graph = graph
        self.roots = list(roots)
        self.trees = list(trees)
        self.shares, self.t_value, _, _ = solve_with_duals(graph, self.trees)
        self._reversed = dataclasses.replace(graph, up=graph.down, down=graph.up)

    def delay(self, k: int, edges: EdgeSet | None = None) -> float:
        """Seconds per Mbit of root k's tree (or ``edges`` rooted there) up and back down: Theorem 1's
        push delay plus the results' delay, one chunk's trip through the pipeline."""
        tree = self.trees[k] if edges is None else edges
        root = np.array([self.roots[k]])
        return float(self.graph.delays_to(tree, root)[0] + self._reversed.delays_to(tree, root)[0])

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
            candidates = [shallow_tree(self.graph, self.roots[k], weight, slack) for slack in SLACKS]
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


def shallow_tree(graph: PackingGraph, root: int, weight: np.ndarray, slack: int = 0) -> EdgeSet:
    """Prim's tree from node index ``root`` under ``weight``, no node more than ``slack`` hops deeper
    than its BFS depth; ties go to the shallower join, then the faster edge, then the node ids.

    Always spanning: a node's BFS predecessor sits at most ``slack`` below its own BFS depth, so it is
    a parent the bound admits.
    """
    n = graph.n
    u, v = graph.u.tolist(), graph.v.tolist()
    adjacency: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for e, (a, b) in enumerate(zip(u, v, strict=True)):
        adjacency[a].append((b, e))
        adjacency[b].append((a, e))
    hops = shortest_path(csr_matrix((np.ones(graph.m), (graph.u, graph.v)), shape=(n, n)), directed=False,
                         unweighted=True, indices=root)
    bound = [int(h) + slack for h in hops.tolist()]
    speed = (graph.up + graph.down).tolist()
    cost = np.round(weight, 12).tolist()
    depth = {root: 0}
    chosen: list[int] = []
    heap: list[tuple[float, int, float, int, int, int]] = []

    def offer(x: int) -> None:
        for y, e in adjacency[x]:
            if y not in depth and depth[x] + 1 <= bound[y]:
                heapq.heappush(heap, (cost[e], depth[x] + 1, speed[e], x, y, e))

    offer(root)
    while heap and len(depth) < n:
        _, d, _, _, y, e = heapq.heappop(heap)
        if y in depth:
            continue
        depth[y] = d
        chosen.append(e)
        offer(y)
    return tuple(sorted(chosen))


def refine_roots(graph: PackingGraph, roots: Sequence[int], trees: Sequence[EdgeSet], *,
                 sweeps: int = SWEEPS) -> Search:
    """The better of the searches from ``trees`` and from every root's shallowest tree."""
    zero = np.zeros(graph.m)
    best: Search | None = None
    for start in (list(trees), [shallow_tree(graph, r, zero) for r in roots]):
        search = Search(graph, roots, start)
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
    search beats it. Roots left with the same tree split its share equally (the loads are the same),
    so every root keeps aggregating a part of the model.
    """
    packing_graph = PackingGraph.from_graph(graph)
    seed_sets = [s for s in (packing_graph.edge_set(t) for t in seeds) if s is not None]
    packing = pack_trees(packing_graph, seeds=seed_sets, max_trees=len(roots))
    trees, share = assign_roots(packing_graph, packing, roots)
    index = [packing_graph.position[r] for r in roots]
    assigned = Search(packing_graph, index, [_edges(packing_graph, trees[r]) for r in roots])
    search = refine_roots(packing_graph, index, assigned.trees)
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
