"""Algorithm 3 against a plain networkx implementation, and the properties the sender relies on."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from netstorm.errors import PolicyError
from netstorm.planning import auxpath
from netstorm.planning.auxpath import auxiliary_paths, edge_disjoint_paths, path_cost
from netstorm.planning.rategraph import RateGraph
from tests.policy_graphs import internet2, random_overlay


def _reference_costs(rates, src: int, dst: int) -> list[float]:
    """Successive shortest paths with networkx, removing each path's edges."""
    graph = nx.DiGraph()
    for (a, b), s in rates.items():
        graph.add_edge(a, b, w=1.0 / s)
    costs: list[float] = []
    while True:
        try:
            path = nx.dijkstra_path(graph, src, dst, weight="w")
        except nx.NetworkXNoPath:
            return costs
        costs.append(sum(graph[a][b]["w"] for a, b in itertools.pairwise(path)))
        graph.remove_edges_from(list(itertools.pairwise(path)))


def _check_properties(rates, pair, paths):
    src, dst = pair
    used: set[tuple[int, int]] = set()
    graph = RateGraph.from_rates(rates)
    previous = 0.0
    for path in paths:
        assert path[0] == src and path[-1] == dst
        assert len(set(path)) == len(path)  # simple
        edges = set(itertools.pairwise(path))
        assert all(e in rates for e in edges)
        assert not edges & used  # edge-disjoint from every earlier path of the pair
        used |= edges
        cost = path_cost(graph, path)
        assert cost >= previous * (1 - 1e-12)  # each later path no faster
        previous = cost


def test_hand_worked_internet2_pair():
    # 1->2 direct: 1/54 = 0.01852; 1->3->2: 1/85 + 1/135 = 0.01917. After both, 1 has no out-link left.
    assert edge_disjoint_paths(RateGraph.from_rates(internet2()), 1, 2) == ((1, 2), (1, 3, 2))


@pytest.mark.parametrize(("tail_rows", "batch"), [(0, 4096), (24, 4096), (10_000, 4096), (5, 50)])
def test_all_pairs_match_networkx(monkeypatch, tail_rows, batch):
    """Same path costs as the plain algorithm, whether searches run in lockstep, one by one, both, or
    in batches of pairs."""
    monkeypatch.setattr(auxpath, "TAIL_ROWS", tail_rows)
    monkeypatch.setattr(auxpath, "BATCH_PAIRS", batch)
    rates = random_overlay(12, 4, seed=7)
    result = auxiliary_paths(RateGraph.from_rates(rates))
    assert len(result) == 12 * 11
    graph = RateGraph.from_rates(rates)
    for pair, paths in result.items():
        _check_properties(rates, pair, paths)
        expected = _reference_costs(rates, *pair)
        assert [path_cost(graph, p) for p in paths] == pytest.approx(expected, rel=1e-12)


def test_one_way_links_and_unreachable_pairs():
    rates = {(1, 2): 10.0, (2, 3): 10.0, (3, 1): 10.0, (1, 3): 1.0}
    result = auxiliary_paths(RateGraph.from_rates(rates), [(1, 3), (3, 2)])
    assert result[(1, 3)] == ((1, 2, 3), (1, 3))  # 0.1 + 0.1 beats the direct 1.0
    assert result[(3, 2)] == ((3, 1, 2),)


def test_rejects_bad_pairs():
    graph = RateGraph.from_rates(internet2())
    with pytest.raises(PolicyError, match="distinct"):
        auxiliary_paths(graph, [(1, 1)])
    with pytest.raises(PolicyError, match="not in the overlay"):
        auxiliary_paths(graph, [(1, 42)])
    assert auxiliary_paths(graph, []) == {}


def test_without_direct_searches_the_graph_minus_the_link():
    rates = random_overlay(12, 4, seed=3)
    graph = RateGraph.from_rates(rates)
    links = sorted(rates)
    result = auxiliary_paths(graph, links, without_direct=True)
    for pair, paths in result.items():
        reduced = {link: s for link, s in rates.items() if link != pair}
        _check_properties(reduced, pair, paths)
        assert [path_cost(graph, p) for p in paths] == pytest.approx(_reference_costs(reduced, *pair), rel=1e-12)


def test_entry_bound_never_overestimates_and_is_consistent():
    """The A* bound through t's unused in-links, against exact distances in the graph without s -> t."""
    rates = random_overlay(15, 4, seed=11)
    graph = RateGraph.from_rates(rates)
    pairs = sorted(rates)[:20]
    s = np.array([graph.index[a] for a, _ in pairs])
    t = np.array([graph.index[b] for _, b in pairs])
    bounds = auxpath._EntryBound(graph, t)
    codes = graph.src * graph.n + graph.dst
    direct = np.searchsorted(codes, s * graph.n + t)
    bounds.remove(np.arange(len(pairs)), direct)
    h = bounds.bounds(np.arange(len(pairs)), t)
    for k, (a, b) in enumerate(pairs):
        reduced = nx.DiGraph()
        reduced.add_nodes_from(graph.nodes)
        reduced.add_weighted_edges_from((x, y, 1 / r) for (x, y), r in rates.items() if (x, y) != (a, b))
        exact = nx.single_source_dijkstra_path_length(reduced.reverse(), b)
        for node in graph.nodes:
            assert h[k, graph.index[node]] <= exact.get(node, float("inf")) * (1 + 1e-12)
        for (x, y), r in rates.items():  # consistency on every link the search may use
            if (x, y) != (a, b):
                assert h[k, graph.index[x]] <= 1 / r + h[k, graph.index[y]] + 1e-12


def test_compiled_search_matches_its_python_source():
    """The numba build of the search loop returns exactly what the same code interpreted does, on a graph
    full of ties (every rate equal), where any difference in pop order or comparison would show."""
    rates = {link: 50.0 for link in random_overlay(12, 4, seed=5)}
    graph = RateGraph.from_rates(rates)
    wanted = sorted(rates)
    names = auxpath._PathNames(graph)
    inputs = auxpath._kernel_inputs(graph, wanted, True, names)
    compiled = auxpath._compiled()(*inputs)
    interpreted = auxpath._search_rows(*inputs)
    assert compiled[5] == interpreted[5] > len(wanted) // 2
    for got, expected in zip(compiled[:5], interpreted[:5], strict=True):
        np.testing.assert_array_equal(got, expected)


def test_equal_paths_come_in_pop_order(monkeypatch):
    """Two equally fast paths 1->4: the search pops the smaller index first among equal keys, so the
    path through 2 is found before the one through 3 (searches finishing alone in scipy's Dijkstra may
    order ties otherwise, hence no tail here)."""
    monkeypatch.setattr(auxpath, "TAIL_ROWS", 0)
    rates = {(1, 2): 10.0, (2, 4): 10.0, (1, 3): 10.0, (3, 4): 10.0, (4, 1): 10.0}
    assert edge_disjoint_paths(RateGraph.from_rates(rates), 1, 4) == ((1, 2, 4), (1, 3, 4))
