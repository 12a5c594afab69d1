"""Algorithm 3: edge-disjoint auxiliary paths for ordered pairs of nodes.

For (src, dst): take the fastest path (sum of w_trans), record it, remove its edges, repeat until dst is
unreachable. Entry 0 is the primary path; each later path is at least as slow as the one before,
because removing edges never shortens a shortest path. Paths of one pair share no directed link, so a
chunk offloaded onto an auxiliary path never queues behind the primary's traffic on a common link.

A policy needs this for hundreds of pairs every few seconds, so all pairs are searched together: one
A* search per pair, advanced in lockstep with numpy (every step pops one node in every pair's search).
The A* bound is the full graph's cheapest way into dst over an in-link the pair has not used yet
(``_EntryBound``): removed edges only lengthen paths, so it never overestimates and each search still
finds a shortest path of its residual graph, yet it steers the later rounds around the links already
taken. A pair is done when src has no unused out-link, dst no unused in-link, or its search runs dry.
The last few pairs, whose searches run longest, finish one by one with scipy's Dijkstra instead of
holding the lockstep.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from netstorm.errors import PolicyError
from netstorm.fapt import aggregation_distances
from netstorm.rategraph import RateGraph

Path = tuple[int, ...]

TAIL_ROWS = 8
"""Searches left when the lockstep stops and the rest finish one at a time."""
BATCH_PAIRS = 4096
"""Pairs searched in one lockstep; more run in batches, keeping the state arrays to tens of MB."""


class _Searches:
    """Lockstep A* state, one row per pair still looking for paths.

    Arrays are (rows, n) for nodes and (rows, edges) for each row's residual edge weights (removed
    edges weigh inf). The loop indexes them flat: row r's node v sits at r * n + v, its edge e at
    r * edges + e.
    """

    def __init__(self, graph: RateGraph, s: np.ndarray, t: np.ndarray) -> None:
        n, rows = graph.n, len(s)
        self.n = n
        self.pair = np.arange(rows)
        self.s, self.t = s, t
        self.h = np.zeros((rows, n))  # A* bounds, set by the caller before the first restart
        self.g = np.full((rows, n), np.inf)
        self.key = np.full((rows, n), np.inf)  # g + h for open nodes, inf otherwise
        self.pred = np.full((rows, n), -1, dtype=np.int64)  # edge that reached the node
        self.w = np.tile(graph.weight, (rows, 1))
        self.out_left = np.bincount(graph.src, minlength=n)[s].astype(np.int64)
        self.in_left = np.bincount(graph.dst, minlength=n)[t].astype(np.int64)

    def restart(self, rows: np.ndarray) -> None:
        """Begin a fresh search from each row's source."""
        self.g[rows] = np.inf
        self.key[rows] = np.inf
        self.g[rows, self.s[rows]] = 0.0
        self.key[rows, self.s[rows]] = self.h[rows, self.s[rows]]

    def stop(self, rows: np.ndarray) -> None:
        """Make rows inert: nothing open, nothing reached."""
        self.g[rows] = np.inf
        self.key[rows] = np.inf

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows whose pairs have all their paths."""
        for name in ("pair", "s", "t", "h", "g", "key", "pred", "w", "out_left", "in_left"):
            setattr(self, name, getattr(self, name)[mask])


def auxiliary_paths(graph: RateGraph, pairs: Iterable[tuple[int, int]] | None = None, *,
                    without_direct: bool = False) -> dict[tuple[int, int], tuple[Path, ...]]:
    """Algorithm 3 for every pair in ``pairs`` (node ids; default every ordered pair), keys ascending.

    ``without_direct`` searches each pair's graph without its direct link src -> dst: what a tree edge
    can offload onto when the link itself is its primary path.
    """
    wanted: Sequence[tuple[int, int]] = (
        sorted(set(pairs)) if pairs is not None
        else [(a, b) for a in graph.nodes for b in graph.nodes if a != b])
    for a, b in wanted:
        if a == b:
            raise PolicyError(f"auxiliary paths need two distinct nodes, got {a}->{b}")
        for node in (a, b):
            if node not in graph.index:
                raise PolicyError(f"node {node} of pair {a}->{b} is not in the overlay")
    if not wanted:
        return {}
    if len(wanted) > BATCH_PAIRS:
        merged: dict[tuple[int, int], tuple[Path, ...]] = {}
        for start in range(0, len(wanted), BATCH_PAIRS):
            merged.update(auxiliary_paths(graph, wanted[start:start + BATCH_PAIRS], without_direct=without_direct))
        return merged
    found: list[list[Path]] = [[] for _ in wanted]
    s = np.array([graph.index[a] for a, _ in wanted], dtype=np.int64)
    t = np.array([graph.index[b] for _, b in wanted], dtype=np.int64)
    bounds = _EntryBound(graph, t)
    run = _Searches(graph, s, t)
    if without_direct:
        codes = graph.src * graph.n + graph.dst  # ascending: edges are sorted by (src, dst)
        at = np.minimum(np.searchsorted(codes, s * graph.n + t), len(codes) - 1)
        direct = np.flatnonzero(codes[at] == s * graph.n + t)
        run.w[direct, at[direct]] = np.inf
        run.out_left[direct] -= 1
        run.in_left[direct] -= 1
        bounds.remove(direct, at[direct])
    run.h = bounds.bounds(run.pair, t)
    run.restart(run.pair)
    names = _PathNames(graph)

    out_degree = np.bincount(graph.src, minlength=graph.n)
    first_edge = np.concatenate(([0], np.cumsum(out_degree)[:-1]))
    head = graph.dst
    n, width = graph.n, len(graph.src)
    alive = np.ones(len(run.pair), dtype=bool)
    rows = -1
    while True:
        left = int(alive.sum())
        if left <= TAIL_ROWS:
            # A few long searches remain: finish them one by one rather than paying a lockstep step each.
            for r in np.flatnonzero(alive).tolist():
                _finish_alone(graph, run, r, found, names)
            break
        if left * 2 < len(alive):  # compact once half the rows are finished
            run.keep(alive)
            alive = np.ones(len(run.pair), dtype=bool)
        if rows != len(alive):  # flat views and row offsets, renewed after each compaction
            rows = len(alive)
            row_ids = np.arange(rows)
            node_base, edge_base = row_ids * n, row_ids * width
            g, key, pred = run.g.ravel(), run.key.ravel(), run.pred.ravel()
            weights, heuristic = run.w.ravel(), run.h.ravel()
        u = np.argmin(run.key, axis=1)
        at_u = node_base + u
        best = key[at_u]
        dead = alive & (best == np.inf)
        if dead.any():
            alive &= ~dead
            run.stop(np.flatnonzero(dead))
        arrived = alive & (u == run.t)
        if arrived.any():
            done = np.flatnonzero(arrived)
            marked: list[int] = []  # every found path's edges, path after path
            hops: list[int] = []
            step_back = pred.item  # predecessor edge of (row, node) at row * n + node
            for r, pair, src, dst in zip(done.tolist(), run.pair[done].tolist(), run.s[done].tolist(),
                                         run.t[done].tolist(), strict=True):
                edges = names.walk_back(step_back, r * n, src, dst)
                found[pair].append(names.path(edges))
                marked += edges
                hops.append(len(edges))
            ends = np.cumsum(hops)
            last = np.array(marked)[ends - 1]
            weights[np.repeat(done * width, hops) + marked] = np.inf
            run.out_left[done] -= 1
            run.in_left[done] -= 1
            complete = (run.out_left[done] == 0) | (run.in_left[done] == 0)
            alive[done[complete]] = False
            run.stop(done[complete])
            again = done[~complete]
            bounds.remove(run.pair[again], last[~complete])
            run.h[again] = bounds.bounds(run.pair[again], run.t[again])
            run.restart(again)
        # Every row pops u; rows just restarted or stopped have g[u] = inf and relax nothing.
        key[at_u] = np.inf
        # The popped nodes' out-edges, flattened: edge k belongs to row owner[k].
        degree = out_degree[u]
        owner = np.repeat(row_ids, degree)
        ends = np.cumsum(degree)
        out = np.arange(int(ends[-1])) + np.repeat(first_edge[u] - ends + degree, degree)
        at_v = node_base[owner] + head[out]
        cand = g[at_u][owner] + weights[edge_base[owner] + out]
        better = cand < g[at_v]
        hit = at_v[better]
        cand = cand[better]
        g[hit] = cand
        key[hit] = cand + heuristic[hit]
        pred[hit] = out[better]
    return {pair: tuple(paths) for pair, paths in zip(wanted, found, strict=True)}


class _PathNames:
    """Edge-id lists to node-id paths."""

    def __init__(self, graph: RateGraph) -> None:
        self.graph = graph
        self.nodes = graph.nodes
        self.tail = graph.src.tolist()
        self.head = graph.dst.tolist()
        self.tail_id = [graph.nodes[i] for i in self.tail]
        self.head_id = [graph.nodes[i] for i in self.head]

    @cached_property
    def matrix(self) -> csr_matrix:
        """The graph as CSR with data in edge order, for the searches that finish alone."""
        graph = self.graph
        indptr = np.searchsorted(graph.src, np.arange(graph.n + 1))
        return csr_matrix((graph.weight.copy(), graph.dst, indptr), shape=(graph.n, graph.n))

    @cached_property
    def edge_of(self) -> dict[tuple[int, int], int]:
        """Edge id of each (tail index, head index)."""
        return {pair: e for e, pair in enumerate(zip(self.tail, self.head, strict=True))}

    def walk_back(self, pred: Callable[[int], int], base: int, src: int, dst: int) -> list[int]:
        """Edge ids from ``src`` to ``dst``, following the predecessor edges ``pred(base + node)`` back."""
        edges = []
        node = dst
        tail = self.tail
        while node != src:
            edge = pred(base + node)
            edges.append(edge)
            node = tail[edge]
        edges.reverse()
        return edges

    def path(self, edges: list[int]) -> Path:
        """Node ids along ``edges``."""
        return (self.tail_id[edges[0]], *map(self.head_id.__getitem__, edges))


def _distances_to(graph: RateGraph, targets: np.ndarray) -> np.ndarray:
    """dist(x -> target) for each target index (rows) and every node x (columns)."""
    return np.atleast_2d(aggregation_distances(graph, [graph.nodes[i] for i in targets.tolist()], strict=False))


class _EntryBound:
    """A* heuristic per search: the cheapest way into t over an in-link the search may still use.

    Every residual path to t ends with an unused in-link y -> t, so it costs at least the minimum over
    those of dist(x -> y) + w(y, t) in the full graph. The bound only grows as rounds remove in-links of
    t, stays admissible and consistent (a minimum of consistent bounds), and is far tighter than the
    plain distance to t near the nodes whose links were removed.

    ``via[e]`` holds dist(x -> y) + w(e) for every link e = y -> t (plus an all-inf row); each pair
    owns the stretch ``first[p] : first[p] + count[p]`` of ``in_link``/``used``, its target's in-links.
    """

    def __init__(self, graph: RateGraph, t: np.ndarray) -> None:
        e = len(graph.src)
        by_dst = np.argsort(graph.dst, kind="stable")
        in_degree = np.bincount(graph.dst, minlength=graph.n)
        in_first = np.concatenate(([0], np.cumsum(in_degree)[:-1]))
        self.position = np.empty(e, dtype=np.int64)  # of each link among its head's in-links
        self.position[by_dst] = np.arange(e) - in_first[graph.dst[by_dst]]
        self.count = in_degree[t]
        ends = np.cumsum(self.count)
        self.first = ends - self.count
        total = int(ends[-1])
        # One extra, always-unusable entry for pairs whose target has no in-link at all.
        self.in_link = np.full(total + 1, e, dtype=np.int64)
        self.in_link[:total] = by_dst[np.arange(total) + np.repeat(in_first[t] - ends + self.count, self.count)]
        self.used = np.zeros(total + 1, dtype=bool)
        self.used[total] = True
        tails, tail_row = np.unique(graph.src, return_inverse=True)
        self.via = np.full((e + 1, graph.n), np.inf)
        self.via[:e] = _distances_to(graph, tails)[tail_row] + graph.weight[:, None]

    def remove(self, pairs: np.ndarray, edges: np.ndarray) -> None:
        """In-link ``edges[i]`` of pair ``pairs[i]``'s target is used up."""
        self.used[self.first[pairs] + self.position[edges]] = True

    def bounds(self, pairs: np.ndarray, t: np.ndarray) -> np.ndarray:
        """The bound of each of ``pairs`` (targets ``t``) over its unused in-links."""
        if not len(pairs):
            return np.zeros((0, self.via.shape[1]))
        count = self.count[pairs]
        length = np.maximum(count, 1)
        ends = np.cumsum(length)
        starts = ends - length
        entry = np.arange(int(ends[-1])) + np.repeat(self.first[pairs] - starts, length)
        entry[np.repeat(count == 0, length)] = len(self.used) - 1
        values = self.via[self.in_link[entry]]
        values[self.used[entry]] = np.inf
        bound: np.ndarray = np.minimum.reduceat(values, starts, axis=0)
        bound[np.arange(len(pairs)), t] = 0.0
        return bound


def _finish_alone(graph: RateGraph, run: _Searches, r: int, found: list[list[Path]], names: _PathNames) -> None:
    """Complete row ``r``'s remaining rounds with one C Dijkstra per round on its residual graph.

    Removed edges stay in the matrix with an infinite weight: dijkstra then never reaches through them.
    """
    s, t = int(run.s[r]), int(run.t[r])
    matrix = names.matrix  # shared by the rows finishing alone, one after another
    weight = matrix.data  # in edge order: the edges are sorted by (src, dst)
    weight[:] = run.w[r]
    out_left, in_left = int(run.out_left[r]), int(run.in_left[r])
    while out_left and in_left:
        dist, pred = dijkstra(matrix, directed=True, indices=s, return_predecessors=True)
        if not np.isfinite(dist[t]):
            return
        hops = [t]
        while hops[-1] != s:
            hops.append(int(pred[hops[-1]]))
        hops.reverse()
        edges = [names.edge_of[pair] for pair in itertools.pairwise(hops)]
        found[int(run.pair[r])].append(names.path(edges))
        weight[edges] = np.inf
        out_left -= 1
        in_left -= 1


def edge_disjoint_paths(graph: RateGraph, src: int, dst: int) -> tuple[Path, ...]:
    """Algorithm 3's paths from ``src`` to ``dst`` (node ids), primary first."""
    return auxiliary_paths(graph, [(src, dst)])[(src, dst)]


def path_cost(graph: RateGraph, path: Path) -> float:
    """Sum of w_trans along ``path``."""
    return sum(1.0 / graph.rate_of(a, b) for a, b in itertools.pairwise(path))
