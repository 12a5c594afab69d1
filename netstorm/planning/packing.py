"""Fractional spanning-tree packing: the chunk shares and trees that minimise the busiest link's load.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import highspy
import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, dijkstra

from netstorm.errors import PolicyError
from netstorm.planning.rategraph import RateGraph
from netstorm.tree import Tree

__all__ = ["EdgeSet", "Packing", "PackingGraph", "assign_roots", "pack_trees", "rounded_shares", "solve_with_duals"]

SHARE_DECIMALS = 9
"""Shares are rounded to 1e-9: bytes-for-bytes the same policy whatever the LP solver's last bits."""
PRICING_RTOL = 1e-9
"""A tree improves the master only if its reduced cost is below -PRICING_RTOL·T."""
MAX_ROUNDS = 2000
"""Column-generation rounds before stopping with the best restricted optimum found (a safety cap)."""

GREEDY_BUDGET = 400
"""LP solves a greedy choice of at most max_trees trees may spend (pool size x max_trees)."""

EdgeSet = tuple[int, ...]
"""A spanning tree as the ascending indices of its undirected edges in a PackingGraph."""


@dataclass(frozen=True, eq=False)
class PackingGraph:
    """The overlay's undirected edges {u, v} with a link in both directions, and their seconds per Mbit."""

    nodes: tuple[int, ...]
    u: np.ndarray
    """Smaller endpoint (node index), edges ascending by (u, v)."""
    v: np.ndarray
    up: np.ndarray
    """1 / s(u -> v)."""
    down: np.ndarray
    """1 / s(v -> u)."""

    @classmethod
    def from_graph(cls, graph: RateGraph) -> PackingGraph:
        """Keep the pairs linked both ways: a tree edge carries the push one way and the result back."""
        weight = dict(zip(zip(graph.src.tolist(), graph.dst.tolist(), strict=True), graph.weight.tolist(),
                          strict=True))
        pairs = sorted((a, b) for a, b in weight if a < b and (b, a) in weight)
        u = np.array([a for a, _ in pairs], dtype=np.int64)
        v = np.array([b for _, b in pairs], dtype=np.int64)
        up = np.array([weight[(a, b)] for a, b in pairs], dtype=np.float64)
        down = np.array([weight[(b, a)] for a, b in pairs], dtype=np.float64)
        packing_graph = cls(graph.nodes, u, v, up, down)
        if len(packing_graph.spanning_tree(np.zeros(len(pairs)))) != graph.n - 1:
            raise PolicyError("the links present in both directions do not connect every node: no spanning tree")
        return packing_graph

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def m(self) -> int:
        return len(self.u)

    def spanning_tree(self, weight: np.ndarray) -> EdgeSet:
        """Kruskal's minimum spanning tree (forest if disconnected) under ``weight`` per edge.

        Ties go to the faster edge (smaller up + down), then the smaller node ids, so equal duals --
        most links have a zero dual -- still pick fast links, and the result is the same every run.
        """
        order = np.lexsort((self.v, self.u, self.up + self.down, weight))
        leader = list(range(self.n))

        def find(x: int) -> int:
            while leader[x] != x:
                leader[x] = leader[leader[x]]
                x = leader[x]
            return x

        chosen: list[int] = []
        for e in order.tolist():
            a, b = find(int(self.u[e])), find(int(self.v[e]))
            if a != b:
                leader[max(a, b)] = min(a, b)
                chosen.append(e)
                if len(chosen) == self.n - 1:
                    break
        return tuple(sorted(chosen))

    @cached_property
    def _edge_index(self) -> dict[tuple[int, int], int]:
        return {(a, b): e for e, (a, b) in enumerate(zip(self.u.tolist(), self.v.tolist(), strict=True))}

    @cached_property
    def position(self) -> dict[int, int]:
        """Node id -> index."""
        return {node: i for i, node in enumerate(self.nodes)}

    def edge_set(self, tree: Tree) -> EdgeSet | None:
        """``tree``'s edges as an EdgeSet, or None when one of them is not linked both ways."""
        index, position = self._edge_index, self.position
        edges = []
        for child, parent in tree.edges():
            a, b = sorted((position[child], position[parent]))
            e = index.get((a, b))
            if e is None:
                return None
            edges.append(e)
        return tuple(sorted(edges))

    def rooted(self, edges: EdgeSet, root: int) -> Tree:
        """The tree with undirected ``edges`` oriented towards node id ``root``."""
        idx = np.asarray(edges, dtype=np.int64)
        matrix = csr_matrix((np.ones(len(idx)), (self.u[idx], self.v[idx])), shape=(self.n, self.n))
        start = self.position[root]
        order, pred = breadth_first_order(matrix, start, directed=False, return_predecessors=True)
        if len(order) != self.n or len(idx) != self.n - 1:
            raise PolicyError(f"edge set {list(edges)} is not a spanning tree of the overlay")
        depth = [0] * self.n
        for i, up in zip(order[1:].tolist(), pred[order[1:]].tolist(), strict=True):
            depth[i] = depth[up] + 1  # BFS order: a parent's depth is known before its children's
        ids = self.nodes
        parent: dict[int, int | None] = {ids[i]: ids[up] for i, up in enumerate(pred.tolist()) if i != start}
        parent[root] = None
        # A BFS of a spanning tree proves the shape: every node reaches the root, depths are exact.
        return Tree.from_parents(root, parent, dict(zip(ids, depth, strict=True)))

    def delays_to(self, edges: EdgeSet, roots: np.ndarray) -> np.ndarray:
        """Theorem-1 delay of the tree ``edges`` rooted at each node index in ``roots``.

        On a tree the only path from x to r is the tree path, so the largest shortest-path cost to r
        (pushes weigh 1 / s(child -> parent)) is the delay of the tree rooted at r.
        """
        idx = np.asarray(edges, dtype=np.int64)
        # Reversed graph: an edge r' <- x becomes x's cost as a hop towards r'.
        heads = np.concatenate([self.v[idx], self.u[idx]])
        tails = np.concatenate([self.u[idx], self.v[idx]])
        weight = np.concatenate([self.up[idx], self.down[idx]])
        matrix = csr_matrix((weight, (heads, tails)), shape=(self.n, self.n))
        dist: np.ndarray = dijkstra(matrix, directed=True, indices=roots)
        return np.asarray(dist.max(axis=1), dtype=np.float64)

    def load_columns(self, trees: Sequence[EdgeSet]) -> np.ndarray:
        """(2m, len(trees)) seconds per Mbit each tree's unit share puts on every directed link.

        Row 2e is u -> v of edge e, row 2e + 1 is v -> u.
        """
        columns = np.zeros((2 * self.m, len(trees)))
        for k, edges in enumerate(trees):
            idx = np.asarray(edges, dtype=np.int64)
            columns[2 * idx, k] = self.up[idx]
            columns[2 * idx + 1, k] = self.down[idx]
        return columns


@dataclass(frozen=True)
class Packing:
    """A mix of spanning trees: shares (summing to 1) and the busiest link's seconds per Mbit of model."""

    trees: tuple[EdgeSet, ...]
    """Heaviest share first; ties by edge set."""
    shares: tuple[float, ...]
    seconds_per_mbit: float
    """max over directed links of sum of shares over the trees using it / s(link): bulk time = T·M·8e-6."""
    rounds: int
    """Column-generation rounds (master LP solves)."""
    optimal: bool
    """Whether pricing proved the mix optimal over every spanning tree (before any cut to fewer trees)."""


class _Master:
    """The restricted master LP, kept in one HiGHS model so each added tree re-solves from the last basis.

    Column 0 is T, column k + 1 tree k's share; rows 0 .. 2m-1 are the directed links, row 2m the shares'
    sum. Warm starts make a round cost a few simplex pivots instead of a solve from scratch.
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", 1)
        # An added column leaves the last basis primal feasible: primal simplex goes on from it, where
        # presolve would only throw the basis away.
        self.highs.setOptionValue("presolve", "off")
        self.highs.setOptionValue("simplex_strategy", 4)
        inf = highspy.kHighsInf
        self.highs.addRows(rows, np.full(rows, -inf), np.zeros(rows), 0, np.zeros(0, dtype=np.int32),
                           np.zeros(0, dtype=np.int32), np.zeros(0))
        self.highs.addRow(1.0, 1.0, 0, np.zeros(0, dtype=np.int32), np.zeros(0))
        self.highs.addCol(1.0, 0.0, inf, rows, np.arange(rows, dtype=np.int32), -np.ones(rows))
        self.columns = 0

    def add(self, column: np.ndarray) -> None:
        """A tree's unit loads per link (dense, length ``rows``) as a new share variable."""
        nz = np.flatnonzero(column).astype(np.int32)
        index = np.append(nz, np.int32(self.rows))
        self.highs.addCol(0.0, 0.0, highspy.kHighsInf, len(index), index, np.append(column[nz], 1.0))
        self.columns += 1

    def solve(self) -> tuple[np.ndarray, float, np.ndarray, float]:
        """Shares, T, link duals y >= 0 and the share constraint's dual μ."""
        self.highs.run()
        status = self.highs.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise PolicyError(f"tree packing LP failed: {self.highs.modelStatusToString(status)}")
        solution = self.highs.getSolution()
        x = np.asarray(solution.col_value, dtype=np.float64)
        dual = np.asarray(solution.row_dual, dtype=np.float64)
        return x[1:], float(x[0]), np.maximum(-dual[:self.rows], 0.0), float(dual[self.rows])


def rounded_shares(shares: np.ndarray) -> np.ndarray:
    """Shares rounded to SHARE_DECIMALS, the remainder of 1 given to the heaviest."""
    out = np.round(np.maximum(shares, 0.0), SHARE_DECIMALS)
    out[int(np.argmax(out))] += 1.0 - float(out.sum())
    return out


def _packing(graph: PackingGraph, trees: list[EdgeSet], shares: np.ndarray, rounds: int,
             optimal: bool) -> Packing:
    rounded = rounded_shares(shares)
    kept = [(float(s), t) for s, t in zip(rounded.tolist(), trees, strict=True) if s > 0]
    kept.sort(key=lambda item: (-item[0], item[1]))
    final_trees = tuple(t for _, t in kept)
    final_shares = np.array([s for s, _ in kept])
    busiest = float((graph.load_columns(list(final_trees)) @ final_shares).max())
    return Packing(final_trees, tuple(final_shares.tolist()), busiest, rounds, optimal)


def solve_with_duals(graph: PackingGraph, trees: Sequence[EdgeSet]) -> tuple[np.ndarray, float, np.ndarray, float]:
    """Optimal shares over just ``trees``, the busiest link's seconds per Mbit, link duals and μ."""
    master = _Master(2 * graph.m)
    for column in graph.load_columns(trees).T:
        master.add(column)
    return master.solve()


def _solve_subset(graph: PackingGraph, trees: Sequence[EdgeSet]) -> tuple[np.ndarray, float]:
    """Optimal shares over just ``trees`` and the busiest link's seconds per Mbit."""
    shares, t_value, _, _ = solve_with_duals(graph, trees)
    return shares, t_value


def _greedy_subset(graph: PackingGraph, pool: Sequence[EdgeSet], size: int) -> list[EdgeSet]:
    """Forward selection: start empty, add the pool tree that lowers the subset's optimum most."""
    chosen: list[EdgeSet] = []
    best_t = math.inf
    for _ in range(size):
        step: tuple[float, EdgeSet] | None = None
        for tree in pool:
            if tree in chosen:
                continue
            _, t_value = _solve_subset(graph, [*chosen, tree])
            if step is None or t_value < step[0] * (1 - PRICING_RTOL):
                step = (t_value, tree)
        if step is None or step[0] >= best_t * (1 - PRICING_RTOL):
            break
        best_t = step[0]
        chosen.append(step[1])
    return chosen


def pack_trees(graph: PackingGraph, *, seeds: Iterable[EdgeSet] = (), max_trees: int | None = None,
               max_rounds: int = MAX_ROUNDS, greedy_budget: int = GREEDY_BUDGET) -> Packing:
    """The optimal fractional packing by column generation, started from ``seeds`` and two fast trees.

    With ``max_trees`` below the optimum's support, the best of a few subsets of at most ``max_trees``
    trees is kept, each with its optimal shares: the heaviest trees of the optimum; the seeds (so the
    result never loads a link more than the seeds with any shares do); and, while the pool of known
    trees times ``max_trees`` stays within ``greedy_budget`` LP solves, a greedy forward selection.
    The cut result is not optimal over all trees any more (``optimal`` is False).
    """
    if max_trees is not None and max_trees < 1:
        raise PolicyError(f"a packing needs at least one tree, got max_trees={max_trees}")
    seed_list = list(dict.fromkeys(seeds))
    trees: list[EdgeSet] = []
    # The fastest tree by up + down time, and a minimum bottleneck tree (the best single tree alone).
    for tree in (*seed_list, graph.spanning_tree(graph.up + graph.down),
                 graph.spanning_tree(np.maximum(graph.up, graph.down))):
        if tree not in trees:
            trees.append(tree)
    master = _Master(2 * graph.m)
    for column in graph.load_columns(trees).T:
        master.add(column)
    rounds, optimal = 0, False
    while True:
        shares, t_value, y, mu = master.solve()
        rounds += 1
        weight = y[0::2] * graph.up + y[1::2] * graph.down
        candidate = graph.spanning_tree(weight)
        reduced = float(weight[list(candidate)].sum()) - mu
        if reduced >= -PRICING_RTOL * t_value:
            optimal = True
            break
        if candidate in trees or rounds >= max_rounds:
            break  # numerical stall or the cap: the restricted optimum stands
        trees.append(candidate)
        master.add(graph.load_columns([candidate])[:, 0])
    packing = _packing(graph, trees, shares, rounds, optimal)
    if max_trees is None or len(packing.trees) <= max_trees:
        return packing
    subsets = [list(packing.trees[:max_trees])]
    if 0 < len(seed_list) <= max_trees:
        subsets.append(seed_list)
    if len(trees) * max_trees <= greedy_budget:
        subsets.append(_greedy_subset(graph, trees, max_trees))
    best: tuple[float, list[EdgeSet], np.ndarray] | None = None
    for subset in subsets:
        subset_shares, t_value = _solve_subset(graph, subset)
        if best is None or t_value < best[0] * (1 - PRICING_RTOL):
            best = (t_value, subset, subset_shares)
    assert best is not None
    return _packing(graph, best[1], best[2], rounds, False)


def assign_roots(graph: PackingGraph, packing: Packing, roots: Sequence[int]
                 ) -> tuple[dict[int, Tree], dict[int, float]]:
    """Give every root one packed tree; returns the trees rooted there and each root's share.

    Trees go to distinct roots by minimum total Theorem-1 delay (Hungarian assignment), so every tree
    of the packing is used. With fewer trees than roots, each leftover root joins the tree that is
    fastest rooted at it and the roots of a tree split its share equally: a tree's link loads do not
    depend on its root, so the packing's busiest link is unchanged, and every root keeps aggregating a
    part of the model (spreading the roots' summing work) instead of idling with a zero share.
    """
    if len(packing.trees) > len(roots):
        raise PolicyError(f"{len(packing.trees)} trees for {len(roots)} roots: cut the packing to max_trees first")
    root_index = np.array([graph.position[r] for r in roots], dtype=np.int64)
    delay = np.array([graph.delays_to(edges, root_index) for edges in packing.trees])
    tree_rows, root_cols = linear_sum_assignment(delay)
    owner = {int(c): int(r) for r, c in zip(tree_rows.tolist(), root_cols.tolist(), strict=True)}
    for c in range(len(roots)):
        if c not in owner:
            owner[c] = int(np.argmin(delay[:, c]))  # first minimum: the heaviest tree on a tie
    holders = [sum(1 for t in owner.values() if t == k) for k in range(len(packing.trees))]
    trees = {root: graph.rooted(packing.trees[owner[c]], root) for c, root in enumerate(roots)}
    share = {root: packing.shares[owner[c]] / holders[owner[c]] for c, root in enumerate(roots)}
    return trees, share
