"""Static IP routes over the overlay: the paths plain IP traffic takes between DCs.

Baselines whose tree edges join non-adjacent DCs (STAR's far spokes, BKT) ride these routes, and the
emulator installs exactly these, so predictions and emulation agree. Shortest hop count; among equal
paths the lexicographically smallest node sequence, so every process derives the same routes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

Path = tuple[int, ...]


def shortest_hop_routes(nodes: Iterable[int], edges: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Path]:
    """For every ordered pair (src, dst), src != dst, the route src ... dst.

    BFS from each source visiting neighbours in ascending id order yields, for every destination, the
    lexicographically smallest among the shortest paths.
    """
    node_list = sorted(set(nodes))
    adjacency: dict[int, list[int]] = {n: [] for n in node_list}
    for a, b in edges:
        adjacency[a].append(b)
        adjacency[b].append(a)
    for n in adjacency:
        adjacency[n].sort()
    routes: dict[tuple[int, int], Path] = {}
    for src in node_list:
        parent: dict[int, int] = {}
        seen = {src}
        queue = deque([src])
        while queue:
            u = queue.popleft()
            for v in adjacency[u]:
                if v not in seen:
                    seen.add(v)
                    parent[v] = u
                    queue.append(v)
        for dst in node_list:
            if dst == src or dst not in seen:
                continue
            path = [dst]
            while path[-1] != src:
                path.append(parent[path[-1]])
            routes[(src, dst)] = tuple(reversed(path))
    return routes


def next_hop(routes: dict[tuple[int, int], Path], src: int, dst: int) -> int:
    """The neighbour of ``src`` that traffic to ``dst`` leaves through."""
    return routes[(src, dst)][1]
