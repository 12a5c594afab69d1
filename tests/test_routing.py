from __future__ import annotations

import itertools

import networkx as nx

from netstorm import scenario
from netstorm.routing import next_hop, shortest_hop_routes


def test_routes_are_shortest_and_lexicographically_smallest() -> None:
    s = scenario.load("internet2-9")
    edges = [(lk.a, lk.b) for lk in s.links]
    routes = shortest_hop_routes(s.node_ids, edges)
    g = nx.Graph(edges)
    for src, dst in itertools.permutations(s.node_ids, 2):
        best = min(tuple(p) for p in nx.all_shortest_paths(g, src, dst))
        assert routes[(src, dst)] == best
    # hand-checked: the only 4-hop route from 1 to 9 is 1-3-4-6-9
    assert routes[(1, 9)] == (1, 3, 4, 6, 9)
    assert next_hop(routes, 1, 9) == 3


def test_square_tie_break() -> None:
    routes = shortest_hop_routes([1, 2, 3, 4], [(1, 2), (2, 4), (1, 3), (3, 4)])
    assert routes[(1, 4)] == (1, 2, 4)
    assert routes[(4, 1)] == (4, 2, 1)
