"""Fastest aggregation path trees: Theorem 1, Algorithm 1 and Algorithm 2 of the NetStorm paper.

A tree edge child -> parent carries the push, so it weighs w_trans = 1 / s(child -> parent). The
synchronization delay of a tree (Theorem 1) is the largest sum of w_trans over its leaf-to-root paths.
A FAPT rooted at r lays every node's fastest path to r into one tree: a shortest-path in-tree, which
gives every node the smallest possible path cost to r and therefore the smallest Theorem-1 delay of
all spanning trees rooted at r.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse.csgraph import dijkstra

from netstorm.errors import PolicyError
from netstorm.planning.rategraph import RateGraph
from netstorm.tree import Tree

# Two path costs closer than this (relative) count as a tie, broken by the smaller node id, so results
# do not hinge on the last bit of a float sum.
TIE_RTOL = 1e-9


def theorem1_delay(tree: Tree, rates: Mapping[tuple[int, int], float]) -> float:
    """Synchronization delay of ``tree``: max over nodes of the sum of 1/s(child->parent) up to the root.

    Every tree edge must be an overlay link; baselines whose edges ride IP routes use
    ``netstorm.planning.predict`` instead.
    """
    cost: dict[int, float] = {tree.root: 0.0}
    for node in reversed(tree.bottom_up()):  # parents before children
        up = tree.parent[node]
        if up is None:
            continue
        rate = rates.get((node, up))
        if rate is None:
            raise PolicyError(f"tree rooted at {tree.root}: edge {node}->{up} is not an overlay link")
        cost[node] = cost[up] + 1.0 / rate
    return max(cost.values())


def aggregation_distances(graph: RateGraph, roots: Sequence[int] | None = None, *, strict: bool = True
                          ) -> np.ndarray:
    """D[k, v] = cost of the fastest path from node index v to root ``roots[k]`` (all nodes if None).

    Shortest paths *to* a root are shortest paths *from* it in the reversed graph. ``strict`` rejects a
    node that cannot reach a root; otherwise its distance is inf.
    """
    indices = list(range(graph.n)) if roots is None else [graph.index[r] for r in roots]
    if roots is None or graph.has_distances():
        result = graph.distances_to[indices]
    else:
        result = np.atleast_2d(dijkstra(graph.matrix(transpose=True), directed=True, indices=indices))
    unreachable = ~np.isfinite(result)
    if strict and unreachable.any():
        k, v = np.argwhere(unreachable)[0]
        root = graph.nodes[indices[int(k)]]
        node = graph.nodes[int(v)]
        raise PolicyError(f"node {node} has no path to root {root}: the overlay is not strongly connected")
    return result


def quality_scores(graph: RateGraph, dist: np.ndarray, roots: Sequence[int] | None = None) -> dict[int, float]:
    """q_i = 1 / w(T_i), the inverse Theorem-1 delay of the FAPT rooted at i (rows of ``dist``)."""
    names = graph.nodes if roots is None else tuple(roots)
    delays = dist.max(axis=1)
    return {name: (1.0 / float(d) if d > 0 else float("inf")) for name, d in zip(names, delays, strict=True)}


def top_roots(quality: Mapping[int, float], count: int) -> tuple[int, ...]:
    """The ``count`` best-scoring nodes (0 = all), best first; equal scores by ascending id."""
    if count < 0:
        raise PolicyError(f"number of roots must be >= 0, got {count}")
    ranked = sorted(quality, key=lambda n: (-quality[n], n))
    return tuple(ranked if count == 0 else ranked[:count])


def shortest_path_parents(graph: RateGraph, dist: np.ndarray) -> np.ndarray:
    """Parent index of every node in the shortest-path in-trees whose distances are the rows of ``dist``.

    A node's parent is its smallest-id out-neighbour u with D[u] < D[v] and D[u] + w(v, u) = D[v]
    (within TIE_RTOL). The strict D[u] < D[v] keeps the result acyclic whatever the float noise.
    Roots (and nodes that cannot reach the root) get -1.
    """
    dist = np.atleast_2d(dist)
    d_src = dist[:, graph.src]
    d_dst = dist[:, graph.dst]
    tight = (d_dst < d_src) & (d_dst + graph.weight <= d_src * (1.0 + TIE_RTOL))
    parents = np.full(dist.shape, -1, dtype=np.int64)
    # Edges are sorted by (src, dst), so walking them backwards leaves the smallest head written last.
    rows, cols = np.nonzero(tight[:, ::-1])
    edge = len(graph.src) - 1 - cols
    parents[rows, graph.src[edge]] = graph.dst[edge]
    return parents


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Hops to the root for every node of every parent row (-1 marks the root)."""
    rows = np.arange(parents.shape[0])[:, None]
    depth = np.zeros(parents.shape, dtype=np.int64)
    ancestor = parents.copy()
    for _ in range(parents.shape[1]):
        alive = ancestor >= 0
        if not alive.any():
            return depth
        depth += alive
        ancestor = np.where(alive, parents[rows, np.maximum(ancestor, 0)], -1)
    raise PolicyError("parent rows contain a cycle")


def fapt_trees(graph: RateGraph, dist: np.ndarray, roots: Sequence[int]) -> dict[int, Tree]:
    """The FAPT rooted at each of ``roots`` from its row of aggregation distances."""
    parents = shortest_path_parents(graph, dist)
    root_index = np.array([graph.index[r] for r in roots])
    orphan = parents < 0
    orphan[np.arange(len(roots)), root_index] = False
    if orphan.any():
        k, i = np.argwhere(orphan)[0]
        raise PolicyError(f"node {graph.nodes[int(i)]} has no path to root {roots[int(k)]}")
    depth_rows = tree_depths(parents).tolist()
    parent_rows = np.array(graph.nodes)[parents].tolist()  # one conversion for all roots
    nodes = graph.nodes
    trees: dict[int, Tree] = {}
    for root, parent_ids, depths in zip(roots, parent_rows, depth_rows, strict=True):
        parent: dict[int, int | None] = dict(zip(nodes, parent_ids, strict=True))
        parent[root] = None
        trees[root] = Tree.from_parents(root, parent, dict(zip(nodes, depths, strict=True)))
    return trees


@dataclass(frozen=True)
class MultiRootFapt:
    """Algorithm 2's result: the fixed roots, their trees and quality scores."""

    roots: tuple[int, ...]
    trees: dict[int, Tree]
    quality: dict[int, float]
    """Scores of every node on a first decision, of the roots when they were given."""


def find_fastest_aggregation_paths(
    graph: RateGraph, num_roots: int, roots: Sequence[int] | None
) -> tuple[tuple[int, ...], np.ndarray, dict[int, float]]:
    """Algorithm 1: choose R (top-N quality) unless given, and the fastest paths to every root."""
    if roots is not None:
        chosen = tuple(roots)
        if not chosen:
            raise PolicyError("the given root set is empty")
        if len(set(chosen)) != len(chosen):
            raise PolicyError(f"duplicate roots in {list(chosen)}")
        for r in chosen:
            if r not in graph.index:
                raise PolicyError(f"root {r} is not a node of the overlay")
        dist = aggregation_distances(graph, chosen)
        return chosen, dist, quality_scores(graph, dist, chosen)
    if num_roots > graph.n:
        raise PolicyError(f"asked for {num_roots} roots but the overlay has {graph.n} nodes")
    all_dist = aggregation_distances(graph)
    quality = quality_scores(graph, all_dist)
    chosen = top_roots(quality, num_roots)
    rows = [graph.index[r] for r in chosen]
    return chosen, all_dist[rows], quality


def build_multi_root_fapt(graph: RateGraph, num_roots: int = 0, roots: Sequence[int] | None = None) -> MultiRootFapt:
    """Algorithm 2: one FAPT per root, from the latest rates in ``graph``."""
    chosen, dist, quality = find_fastest_aggregation_paths(graph, num_roots, roots)
    return MultiRootFapt(chosen, fapt_trees(graph, dist, chosen), quality)
