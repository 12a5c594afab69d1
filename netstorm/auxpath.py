"""Algorithm 3: edge-disjoint auxiliary paths for ordered pairs of nodes.

For (src, dst): take the fastest path (sum of w_trans), record it, remove its edges, repeat until dst is
unreachable. Entry 0 is the primary path; each later path is at least as slow as the one before,
because removing edges never shortens a shortest path. Paths of one pair share no directed link, so a
chunk offloaded onto an auxiliary path never queues behind the primary's traffic on a common link.

A policy needs this for hundreds of pairs every few seconds, so all pairs are searched together: one
A* search per pair, advanced in lockstep with numpy (every step pops one node in every pair's search).
The heuristic is the distance to dst in the full graph, which removed edges can only lengthen, so it
never overestimates and each search still finds a shortest path of its residual graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from netstorm.errors import PolicyError
from netstorm.fapt import aggregation_distances
from netstorm.rategraph import RateGraph

Path = tuple[int, ...]

TAIL_ROWS = 24
"""Searches left when the lockstep stops and the rest finish one at a time."""


class _Searches:
    """Lockstep A* state, one row per pair still looking for its next path."""

    def __init__(self, graph: RateGraph, s: np.ndarray, t: np.ndarray, heuristic: np.ndarray) -> None:
        n, e = graph.n, len(graph.src)
        rows = len(s)
        self.pair = np.arange(rows)
        self.s, self.t, self.h = s, t, heuristic
        self.g = np.full((rows, n), np.inf)
        self.key = np.full((rows, n), np.inf)  # g + h for open nodes, inf otherwise
        self.closed = np.zeros((rows, n), dtype=bool)
        self.pred_edge = np.full((rows, n), -1, dtype=np.int64)
        # Column e is the padding edge of the out-edge table: always "removed".
        self.removed = np.zeros((rows, e + 1), dtype=bool)
        self.removed[:, e] = True
        self.out_left = np.bincount(graph.src, minlength=n)[s].astype(np.int64)
        self.in_left = np.bincount(graph.dst, minlength=n)[t].astype(np.int64)
        self.restart(np.arange(rows))

    def restart(self, rows: np.ndarray) -> None:
        """Begin a fresh search from each row's source."""
        self.g[rows] = np.inf
        self.key[rows] = np.inf
        self.closed[rows] = False
        self.pred_edge[rows] = -1
        self.g[rows, self.s[rows]] = 0.0
        self.key[rows, self.s[rows]] = self.h[rows, self.s[rows]]

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows whose pairs have all their paths."""
        for name in ("pair", "s", "t", "h", "g", "key", "closed", "pred_edge", "removed", "out_left", "in_left"):
            setattr(self, name, getattr(self, name)[mask])


def _out_edge_table(graph: RateGraph) -> np.ndarray:
    """(n, max out-degree) edge ids per tail, padded with the sentinel edge id len(edges)."""
    e = len(graph.src)
    degree = np.bincount(graph.src, minlength=graph.n)
    width = max(int(degree.max()), 1)
    table = np.full((graph.n, width), e, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(degree)[:-1]))
    slot = np.arange(e) - starts[graph.src]
    table[graph.src, slot] = np.arange(e)
    return table


def auxiliary_paths(graph: RateGraph, pairs: Iterable[tuple[int, int]] | None = None
                    ) -> dict[tuple[int, int], tuple[Path, ...]]:
    """Algorithm 3 for every pair in ``pairs`` (node ids; default every ordered pair), keys ascending."""
    wanted: Sequence[tuple[int, int]] = (
        sorted(set(pairs)) if pairs is not None
        else [(a, b) for a in graph.nodes for b in graph.nodes if a != b])
    for a, b in wanted:
        if a == b:
            raise PolicyError(f"auxiliary paths need two distinct nodes, got {a}->{b}")
        for node in (a, b):
            if node not in graph.index:
                raise PolicyError(f"node {node} of pair {a}->{b} is not in the overlay")
    found: list[list[Path]] = [[] for _ in wanted]
    if not wanted:
        return {}
    s = np.array([graph.index[a] for a, _ in wanted], dtype=np.int64)
    t = np.array([graph.index[b] for _, b in wanted], dtype=np.int64)
    targets, t_row = np.unique(t, return_inverse=True)
    to_target = np.atleast_2d(_distances_to(graph, targets))
    run = _Searches(graph, s, t, to_target[t_row])

    table = _out_edge_table(graph)
    head = np.append(graph.dst, 0)
    tail = np.append(graph.src, 0)
    weight = np.append(graph.weight, np.inf)
    nodes = np.array(graph.nodes)

    n, width = graph.n, len(graph.src) + 1
    alive = np.ones(len(run.pair), dtype=bool)
    while alive.any():
        if alive.sum() <= TAIL_ROWS:
            # A few long searches remain: finish them one by one rather than paying a lockstep step each.
            for r in np.flatnonzero(alive).tolist():
                _finish_alone(graph, run, r, found, nodes)
            break
        if alive.sum() * 2 < len(alive):  # compact once half the rows are finished
            run.keep(alive)
            alive = np.ones(len(run.pair), dtype=bool)
        rows = np.arange(len(alive))
        u = np.argmin(run.key, axis=1)
        best = run.key[rows, u]
        alive &= np.isfinite(best) & (run.out_left > 0) & (run.in_left > 0)
        arrived = alive & (u == run.t)
        if arrived.any():
            done = rows[arrived]
            for r, path_edges in zip(done.tolist(), _walk_back(run, done, tail), strict=True):
                run.removed[r, path_edges] = True
                hops = [int(run.s[r]), *head[path_edges].tolist()]
                found[int(run.pair[r])].append(tuple(nodes[hops].tolist()))
            run.out_left[done] -= 1
            run.in_left[done] -= 1
            run.restart(done)
        step = rows[alive & ~arrived]
        if not len(step):
            continue
        # Flat indices into the (rows, n) and (rows, edges + 1) state arrays.
        g, key, closed = run.g.ravel(), run.key.ravel(), run.closed.ravel()
        base = step * n
        at_u = base + u[step]
        key[at_u] = np.inf
        closed[at_u] = True
        edges = table[u[step]]  # (step rows, width) out-edges of each popped node
        at_v = base[:, None] + head[edges]
        cand = g[at_u][:, None] + weight[edges]
        better = ~run.removed.ravel()[step[:, None] * width + edges] & ~closed[at_v] & (cand < g[at_v])
        hit = at_v[better]
        g[hit] = cand[better]
        key[hit] = cand[better] + run.h.ravel()[hit]
        run.pred_edge.ravel()[hit] = edges[better]
    return {pair: tuple(paths) for pair, paths in zip(wanted, found, strict=True)}


def _distances_to(graph: RateGraph, targets: np.ndarray) -> np.ndarray:
    """dist(x -> target) for each target index (rows) and every node x (columns)."""
    return aggregation_distances(graph, [graph.nodes[i] for i in targets.tolist()], strict=False)


def _finish_alone(graph: RateGraph, run: _Searches, r: int, found: list[list[Path]], nodes: np.ndarray) -> None:
    """Complete row ``r``'s remaining rounds with one C Dijkstra per round on its residual graph."""
    e = len(graph.src)
    s, t = int(run.s[r]), int(run.t[r])
    removed = run.removed[r, :e].copy()
    while True:
        keep = ~removed
        matrix = csr_matrix((graph.weight[keep], (graph.src[keep], graph.dst[keep])), shape=(graph.n, graph.n))
        dist, pred = dijkstra(matrix, directed=True, indices=s, return_predecessors=True)
        if not np.isfinite(dist[t]):
            return
        hops = [t]
        while hops[-1] != s:
            hops.append(int(pred[hops[-1]]))
        hops.reverse()
        found[int(run.pair[r])].append(tuple(nodes[hops].tolist()))
        for a, b in itertools.pairwise(hops):
            removed[_edge_id(graph, a, b)] = True


def _edge_id(graph: RateGraph, a: int, b: int) -> int:
    """Position of edge index a -> b in the (src, dst)-sorted edge arrays."""
    lo = int(np.searchsorted(graph.src, a, side="left"))
    hi = int(np.searchsorted(graph.src, a, side="right"))
    return lo + int(np.searchsorted(graph.dst[lo:hi], b))


def _walk_back(run: _Searches, rows: np.ndarray, tail: np.ndarray) -> list[list[int]]:
    """Edge ids of each row's found path s -> t, walking the search trees back in lockstep."""
    cur = run.t[rows].copy()
    columns = []
    while True:
        active = cur != run.s[rows]
        if not active.any():
            break
        edge = np.where(active, run.pred_edge[rows, cur], -1)
        columns.append(edge)
        cur = np.where(active, tail[np.maximum(edge, 0)], cur)
    steps = np.array(columns).T.tolist()  # (rows, longest path), -1 after a row's source
    return [[e for e in reversed(row) if e >= 0] for row in steps]


def edge_disjoint_paths(graph: RateGraph, src: int, dst: int) -> tuple[Path, ...]:
    """Algorithm 3's paths from ``src`` to ``dst`` (node ids), primary first."""
    return auxiliary_paths(graph, [(src, dst)])[(src, dst)]


def path_cost(graph: RateGraph, path: Path) -> float:
    """Sum of w_trans along ``path``."""
    return sum(1.0 / graph.rate_of(a, b) for a, b in itertools.pairwise(path))
