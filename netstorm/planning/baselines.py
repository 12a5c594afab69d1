"""The paper's comparison systems as single-root trees for the same runtime.

STAR is MXNet's parameter server at one hub (``star``: the hub whose physical bound is smallest;
``star-mxnet``: the best-connected hub an MXNet user would pick), BKT a balanced k-way tree (MLNET), MST a maximum-
throughput spanning tree (TSEngine). STAR and BKT ignore the overlay's shape, so their tree edges may
join DCs that share no link; that traffic rides the static IP routes (``netstorm.routing``).
"""

from __future__ import annotations

import itertools
from collections import deque

from netstorm.errors import PolicyError
from netstorm.planning.rategraph import RateGraph
from netstorm.routing import shortest_hop_routes
from netstorm.scenario import Rates
from netstorm.tree import Tree


def best_connected(graph: RateGraph) -> int:
    """The hub an operator would pick: the largest total rate in and out; ties by ascending id."""
    total = [0.0] * graph.n
    for a, b, s in zip(graph.src.tolist(), graph.dst.tolist(), graph.rate.tolist(), strict=True):
        total[a] += s
        total[b] += s
    best = max(range(graph.n), key=lambda i: (total[i], -i))
    return graph.nodes[best]


def star_bounds(model_bytes: int, rates: Rates) -> dict[int, float]:
    """Per hub, the least time a STAR parameter server there needs over the static routes.

    With hub h, every other DC's gradient travels its route to h and the sum travels back along h's
    routes, M bytes each; a directed link carrying c of these flows needs c·M / rate however they are
    scheduled, so the busiest link decides. The routes are the emulator's (``netstorm.routing``).
    """
    nodes = sorted({a for a, _ in rates} | {b for _, b in rates})
    routes = shortest_hop_routes(nodes, [(a, b) for a, b in rates if a < b or (b, a) not in rates])
    out: dict[int, float] = {}
    for hub in nodes:
        load: dict[tuple[int, int], int] = {}
        for other in nodes:
            if other == hub:
                continue
            for path in (routes[(other, hub)], routes[(hub, other)]):
                for hop in itertools.pairwise(path):
                    load[hop] = load.get(hop, 0) + 1
        if any(hop not in rates for hop in load):
            continue  # a route over a link with no rate in this direction: no bound to give
        out[hub] = max((count * model_bytes * 8 / (rates[hop] * 1e6) for hop, count in load.items()), default=0.0)
    return out


def star_bound(model_bytes: int, rates: Rates) -> tuple[float, int]:
    """(seconds, hub) of the best STAR hub: the smallest bound, ties by ascending id."""
    bounds = star_bounds(model_bytes, rates)
    if not bounds:
        raise PolicyError("no STAR hub has a route to and from every DC over links with rates")
    hub = min(bounds, key=lambda h: (bounds[h], h))
    return bounds[hub], hub


def best_bound_hub(rates: Rates) -> int:
    """The STAR hub with the smallest physical bound at ``rates`` (the model's size only scales it)."""
    return star_bound(1, rates)[1]


def _check_node(graph: RateGraph, node: int, role: str) -> None:
    if node not in graph.index:
        raise PolicyError(f"{role} {node} is not a node of the overlay (nodes: {list(graph.nodes)})")


def star_tree(graph: RateGraph, hub: int) -> Tree:
    """Every node's parent is the hub."""
    _check_node(graph, hub, "hub")
    return Tree(hub, {n: (None if n == hub else hub) for n in graph.nodes})


def bfs_order(graph: RateGraph, root: int) -> list[int]:
    """Nodes by hop distance from ``root`` over the undirected overlay, neighbours in ascending id."""
    neighbours: dict[int, list[int]] = {n: [] for n in graph.nodes}
    for a, b in graph.undirected_edges():
        neighbours[a].append(b)
        neighbours[b].append(a)
    order = [root]
    seen = {root}
    queue = deque([root])
    while queue:
        for v in sorted(neighbours[queue.popleft()]):
            if v not in seen:
                seen.add(v)
                order.append(v)
                queue.append(v)
    order.extend(n for n in graph.nodes if n not in seen)
    return order


def bkt_tree(graph: RateGraph, root: int, k: int) -> Tree:
    """Balanced k-way tree: nodes in BFS order from ``root`` laid out as a heap (parent of i is (i-1)//k).

    Near DCs land near the root, as an operator would arrange them; the tree's shape is otherwise blind
    to rates, like MLNET's.
    """
    if k < 1:
        raise PolicyError(f"BKT fan-out k must be >= 1, got {k}")
    _check_node(graph, root, "root")
    order = bfs_order(graph, root)
    parent: dict[int, int | None] = {root: None}
    for i in range(1, len(order)):
        parent[order[i]] = order[(i - 1) // k]
    return Tree(root, parent)


def maximum_spanning_edges(graph: RateGraph) -> list[tuple[int, int]]:
    """Kruskal on links weighted by the slower of their two directions, heaviest first, ties by ids.

    A tree edge carries the push one way and the result the other, so its slower direction limits it;
    a link missing one direction cannot carry both and is left out.
    """
    rate: dict[tuple[int, int], float] = {}
    for a, b, s in zip(graph.src.tolist(), graph.dst.tolist(), graph.rate.tolist(), strict=True):
        rate[(a, b)] = s
    candidates = []
    for (a, b), s in rate.items():
        back = rate.get((b, a))
        if a < b and back is not None:
            candidates.append((-min(s, back), a, b))
    candidates.sort()
    leader = list(range(graph.n))

    def find(x: int) -> int:
        while leader[x] != x:
            leader[x] = leader[leader[x]]
            x = leader[x]
        return x

    chosen: list[tuple[int, int]] = []
    for _, a, b in candidates:
        ra, rb = find(a), find(b)
        if ra != rb:
            leader[max(ra, rb)] = min(ra, rb)
            chosen.append((graph.nodes[a], graph.nodes[b]))
    if len(chosen) != graph.n - 1:
        raise PolicyError("no spanning tree of bidirectional links: the overlay is not connected both ways")
    return chosen


def orient(nodes: tuple[int, ...], edges: list[tuple[int, int]], root: int) -> Tree:
    """Root an undirected spanning tree at ``root``."""
    neighbours: dict[int, list[int]] = {n: [] for n in nodes}
    for a, b in edges:
        neighbours[a].append(b)
        neighbours[b].append(a)
    parent: dict[int, int | None] = {root: None}
    queue = deque([root])
    while queue:
        u = queue.popleft()
        for v in sorted(neighbours[u]):
            if v not in parent:
                parent[v] = u
                queue.append(v)
    return Tree(root, parent)
