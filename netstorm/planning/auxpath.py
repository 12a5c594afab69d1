"""Algorithm 3: edge-disjoint auxiliary paths for ordered pairs of nodes.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import cache, cached_property
from typing import Any

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from netstorm.errors import PolicyError
from netstorm.planning.fapt import aggregation_distances
from netstorm.planning.rategraph import RateGraph

Path = tuple[int, ...]

TAIL_ROWS = 8
"""Searches left when the lockstep stops and the rest finish one at a time."""
BATCH_PAIRS = 4096
"""Pairs searched in one lockstep; more run in batches, each with its own tail."""


def _search_rows(first_edge: np.ndarray, head: np.ndarray, tail: np.ndarray, weight: np.ndarray,
                 s: np.ndarray, t: np.ndarray, direct: np.ndarray, out_left0: np.ndarray,
                 in_left0: np.ndarray, via: np.ndarray, in_link: np.ndarray, first: np.ndarray,
                 count: np.ndarray, position: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Every pair's rounds of A*, pair after pair, as the lockstep would run them (compiled by numba).

    Per step a search pops its open node of smallest key (g + h, the smallest index on ties; inf: the
    search ran dry), or on popping t records the path, removes its edges and restarts from s with the
    bound over t's remaining in-links. Returns each row's finishing step, and per path its row, the
    step it was found at, the end of its edges in ``edges`` (edge ids, src first) and the path count.
    """
    inf = np.inf
    rows = s.shape[0]
    n = first_edge.shape[0] - 1
    finish = np.empty(rows, np.int64)
    path_cap = 4 * rows + 16
    path_row = np.empty(path_cap, np.int64)
    path_step = np.empty(path_cap, np.int64)
    path_end = np.empty(path_cap, np.int64)
    edge_cap = 16 * rows + 4 * n
    edges = np.empty(edge_cap, np.int64)
    paths = 0
    filled = 0
    w = np.empty(weight.shape[0])
    g = np.empty(n)
    key = np.empty(n)
    h = np.empty(n)
    pred = np.full(n, -1, np.int64)
    back = np.empty(n, np.int64)
    used = np.zeros(count.max() + 1 if rows else 1, np.bool_)
    for r in range(rows):
        src = s[r]
        dst = t[r]
        start = first[r]
        links = count[r]
        w[:] = weight
        used[:] = False
        out_left = out_left0[r]
        in_left = in_left0[r]
        d = direct[r]
        if d >= 0:
            w[d] = inf
            out_left -= 1
            in_left -= 1
            used[position[d]] = True
        restart = True
        step = 0
        while True:
            if restart:
                restart = False
                h[:] = inf
                for i in range(links):
                    if not used[i]:
                        row = in_link[start + i]
                        for v in range(n):
                            if via[row, v] < h[v]:
                                h[v] = via[row, v]
                h[dst] = 0.0
                g[:] = inf
                key[:] = inf
                g[src] = 0.0
                key[src] = h[src]
            u = 0
            best = key[0]
            for v in range(1, n):
                if key[v] < best:
                    best = key[v]
                    u = v
            if best == inf:
                break
            if u == dst:
                hops = 0
                v = dst
                while v != src:
                    e = pred[v]
                    back[hops] = e
                    hops += 1
                    v = tail[e]
                if filled + hops > edge_cap:
                    edge_cap = 2 * edge_cap + hops
                    grown = np.empty(edge_cap, np.int64)
                    grown[:filled] = edges[:filled]
                    edges = grown
                if paths == path_cap:
                    path_cap *= 2
                    grown_row = np.empty(path_cap, np.int64)
                    grown_step = np.empty(path_cap, np.int64)
                    grown_end = np.empty(path_cap, np.int64)
                    grown_row[:paths] = path_row[:paths]
                    grown_step[:paths] = path_step[:paths]
                    grown_end[:paths] = path_end[:paths]
                    path_row, path_step, path_end = grown_row, grown_step, grown_end
                for i in range(hops):
                    e = back[hops - 1 - i]
                    edges[filled + i] = e
                    w[e] = inf
                filled += hops
                path_row[paths] = r
                path_step[paths] = step
                path_end[paths] = filled
                paths += 1
                out_left -= 1
                in_left -= 1
                if out_left == 0 or in_left == 0:
                    break
                used[position[back[0]]] = True
                restart = True
                step += 1
                continue
            key[u] = inf
            gu = g[u]
            for e in range(first_edge[u], first_edge[u + 1]):
                v = head[e]
                cand = gu + w[e]
                if cand < g[v]:
                    g[v] = cand
                    key[v] = cand + h[v]
                    pred[v] = e
            step += 1
        finish[r] = step
    return finish, path_row[:paths], path_step[:paths], path_end[:paths], edges[:filled], paths


@cache
def _compiled() -> Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]:
    """``_search_rows`` compiled on first use (cached on disk by numba, so later processes skip it)."""
    import numba  # imported here: only planning needs it, and it takes a moment to load

    compiled: Any = numba.njit(cache=True, nogil=True)(_search_rows)
    return compiled


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
    names = _PathNames(graph)
    merged: dict[tuple[int, int], tuple[Path, ...]] = {}
    for begin in range(0, len(wanted), BATCH_PAIRS):
        batch = wanted[begin:begin + BATCH_PAIRS]
        for pair, paths in zip(batch, _batch_paths(graph, batch, without_direct, names), strict=True):
            merged[pair] = tuple(paths)
    return merged


def _kernel_inputs(graph: RateGraph, wanted: Sequence[tuple[int, int]], without_direct: bool,
                   names: _PathNames) -> tuple[np.ndarray, ...]:
    """``_search_rows``'s arguments for the pairs ``wanted``."""
    s = np.array([graph.index[a] for a, _ in wanted], dtype=np.int64)
    t = np.array([graph.index[b] for _, b in wanted], dtype=np.int64)
    n = graph.n
    bounds = _EntryBound(graph, t)
    direct = np.full(len(wanted), -1, dtype=np.int64)
    if without_direct:
        codes = graph.src * n + graph.dst  # ascending: edges are sorted by (src, dst)
        at = np.minimum(np.searchsorted(codes, s * n + t), len(codes) - 1)
        has = codes[at] == s * n + t
        direct[has] = at[has]
    out_left = np.bincount(graph.src, minlength=n)[s].astype(np.int64)
    in_left = np.bincount(graph.dst, minlength=n)[t].astype(np.int64)
    return (names.first_edge, graph.dst, graph.src, graph.weight, s, t, direct, out_left, in_left,
            bounds.via, bounds.in_link, bounds.first, bounds.count, bounds.position)


def _batch_paths(graph: RateGraph, wanted: Sequence[tuple[int, int]], without_direct: bool,
                 names: _PathNames) -> list[list[Path]]:
    """One lockstep's paths for ``wanted``, in its order."""
    inputs = _kernel_inputs(graph, wanted, without_direct, names)
    s, t, direct, out_left, in_left = inputs[4:9]
    finish, path_row, path_step, path_end, edges, _ = _compiled()(*inputs)
    # The lockstep stops at the first step with at most TAIL_ROWS searches left; those finish alone
    # from the paths they had found before it.
    cutoff = 0 if len(wanted) <= TAIL_ROWS else int(-np.partition(-finish, TAIL_ROWS)[TAIL_ROWS]) + 1
    tail_rows = np.flatnonzero(finish >= cutoff)
    keep = path_step < cutoff  # every path of a row that finished before the cutoff, too
    found: list[list[Path]] = [[] for _ in wanted]
    begins = np.concatenate(([0], path_end[:-1]))
    kept = np.flatnonzero(keep)
    for row, path in zip(path_row[kept].tolist(), names.paths(edges, begins[kept], path_end[kept]), strict=True):
        found[row].append(path)
    for r in tail_rows.tolist():
        w = graph.weight.copy()
        mine = np.flatnonzero((path_row == r) & keep)
        for p in mine.tolist():
            w[edges[begins[p]:path_end[p]]] = np.inf
        lost = len(mine)
        if direct[r] >= 0:
            w[direct[r]] = np.inf
            lost += 1
        _finish_alone(names, int(s[r]), int(t[r]), w, int(out_left[r]) - lost, int(in_left[r]) - lost, found[r])
    return found


class _PathNames:
    """Edge-id lists to node-id paths."""

    def __init__(self, graph: RateGraph) -> None:
        self.graph = graph
        self.tail_id = np.array(graph.nodes)[graph.src]
        self.head_id = np.array(graph.nodes)[graph.dst]

    @cached_property
    def first_edge(self) -> np.ndarray:
        """CSR row pointers: node i's out-links are edges first_edge[i]:first_edge[i + 1]."""
        result: np.ndarray = np.searchsorted(self.graph.src, np.arange(self.graph.n + 1)).astype(np.int64)
        return result

    @cached_property
    def matrix(self) -> csr_matrix:
        """The graph as CSR with data in edge order, for the searches that finish alone."""
        graph = self.graph
        return csr_matrix((graph.weight.copy(), graph.dst, self.first_edge), shape=(graph.n, graph.n))

    @cached_property
    def edge_of(self) -> dict[tuple[int, int], int]:
        """Edge id of each (tail index, head index)."""
        pairs = zip(self.graph.src.tolist(), self.graph.dst.tolist(), strict=True)
        return {pair: e for e, pair in enumerate(pairs)}

    def paths(self, edges: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> list[Path]:
        """Node ids along each stretch ``edges[begins[i]:ends[i]]`` of edge ids."""
        tails = self.tail_id[edges].tolist()
        heads = self.head_id[edges[ends - 1]].tolist() if len(ends) else []
        return [(*tails[b:e], last) for b, e, last in zip(begins.tolist(), ends.tolist(), heads, strict=True)]


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


def _finish_alone(names: _PathNames, s: int, t: int, weight: np.ndarray, out_left: int, in_left: int,
                  found: list[Path]) -> None:
    """Complete one search's remaining rounds with one C Dijkstra per round on its residual graph.

    Removed edges stay in the matrix with an infinite weight: dijkstra then never reaches through them.
    """
    matrix = names.matrix  # shared by the rows finishing alone, one after another
    weights = matrix.data  # in edge order: the edges are sorted by (src, dst)
    weights[:] = weight
    nodes = names.graph.nodes
    while out_left > 0 and in_left > 0:
        dist, pred = dijkstra(matrix, directed=True, indices=s, return_predecessors=True)
        if not np.isfinite(dist[t]):
            return
        hops = [t]
        while hops[-1] != s:
            hops.append(int(pred[hops[-1]]))
        hops.reverse()
        weights[[names.edge_of[pair] for pair in itertools.pairwise(hops)]] = np.inf
        found.append(tuple(nodes[i] for i in hops))
        out_left -= 1
        in_left -= 1


def edge_disjoint_paths(graph: RateGraph, src: int, dst: int) -> tuple[Path, ...]:
    """Algorithm 3's paths from ``src`` to ``dst`` (node ids), primary first."""
    return auxiliary_paths(graph, [(src, dst)])[(src, dst)]


def path_cost(graph: RateGraph, path: Path) -> float:
    """Sum of w_trans along ``path``."""
    return sum(1.0 / graph.rate_of(a, b) for a, b in itertools.pairwise(path))
