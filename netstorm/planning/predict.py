"""Predicted synchronization time of a policy: a fluid model of its bytes on the overlay's links.

For every root r with share σ_r of the M model bytes, each edge child -> parent of r's tree moves σ_r·M
up (the push) and σ_r·M down (the result). An edge between DCs that share no link rides the static IP
route, loading every link on it. Loads are summed per directed link; with chunks pipelined, up and
down streams run at once and the busiest link decides: bulk = max over links of load / rate. Filling
and draining the pipeline adds one chunk's trip up the slowest leaf-to-root path and back down
(Theorem 1 for a single chunk; an IP route passes a chunk at the pace of its slowest link).

Every cut S must carry, out of S, at least M bytes in total (pushes towards roots outside S, results
towards nodes outside S), so the bulk term alone is never below the physical limit M / λ.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from netstorm.errors import PolicyError
from netstorm.planning.rategraph import RateGraph
from netstorm.policy import Policy
from netstorm.routing import shortest_hop_routes
from netstorm.tree import Tree

Routes = dict[tuple[int, int], tuple[int, ...]]


def routes_for(graph: RateGraph) -> Routes:
    """Static shortest-hop IP routes over the overlay (the ones the emulator installs)."""
    return shortest_hop_routes(graph.nodes, graph.undirected_edges())


def route_links(routes: Routes, src: int, dst: int) -> list[tuple[int, int]]:
    """Directed overlay links a packet from ``src`` to ``dst`` crosses."""
    path = routes.get((src, dst))
    if path is None:
        raise PolicyError(f"no IP route {src}->{dst}")
    return list(itertools.pairwise(path))


def _edge_seconds_per_mbit(graph: RateGraph, routes: Routes, src: int, dst: int) -> float:
    """Seconds one Mbit takes from ``src`` to ``dst`` on its route: the slowest link's pace."""
    return max(1.0 / graph.rate_of(a, b) for a, b in route_links(routes, src, dst))


def routed_delay(tree: Tree, graph: RateGraph, routes: Routes, *, down: bool = False) -> float:
    """Theorem-1 delay of ``tree`` with routed edges (seconds per Mbit); ``down`` weighs parent -> child."""
    cost: dict[int, float] = {tree.root: 0.0}
    for node in reversed(tree.bottom_up()):
        up = tree.parent[node]
        if up is None:
            continue
        a, b = (up, node) if down else (node, up)
        cost[node] = cost[up] + _edge_seconds_per_mbit(graph, routes, a, b)
    return max(cost.values())


def link_loads(policy: Policy, graph: RateGraph, model_bytes: float, routes: Routes, *,
               push: bool = True, result: bool = True) -> dict[tuple[int, int], float]:
    """Bytes each directed overlay link carries in one synchronization of ``model_bytes``.

    ``push`` counts the gradients going up, ``result`` the sums coming down; a tree link's planned
    offload (``Policy.offload``) loads its auxiliary paths' links instead of its own.
    """
    loads: dict[tuple[int, int], float] = {}
    for root in policy.roots:
        share_bytes = policy.chunk_share[root] * model_bytes
        for child, parent in policy.trees[root].edges():
            for (a, b), counted in (((child, parent), push), ((parent, child), result)):
                if not counted:
                    continue
                moves = policy.offload.get((a, b), ())
                kept = share_bytes * (1.0 - sum(f for _, f in moves))
                for hop in route_links(routes, a, b):
                    graph.rate_of(*hop)  # the link must exist in this direction
                    loads[hop] = loads.get(hop, 0.0) + kept
                for path, fraction in moves:  # planned detours over auxiliary paths
                    for hop in itertools.pairwise(path):
                        graph.rate_of(*hop)
                        loads[hop] = loads.get(hop, 0.0) + share_bytes * fraction
    return loads


def _busiest(loads: Mapping[tuple[int, int], float], graph: RateGraph) -> tuple[float, tuple[int, int] | None]:
    """Seconds of the busiest link at its rate, and that link (the first in order on a tie)."""
    seconds, link = 0.0, None
    for (a, b), load in sorted(loads.items()):
        t = load * 8 / (graph.rate_of(a, b) * 1e6)
        if t > seconds:
            seconds, link = t, (a, b)
    return seconds, link


@dataclass(frozen=True)
class Prediction:
    """A predicted synchronization time and its parts (seconds)."""

    total_s: float
    bulk_s: float
    """The busiest link's load / rate."""
    fill_s: float
    """One chunk up the slowest path and back down."""
    bottleneck: tuple[int, int] | None
    """The busiest directed link."""
    phased_s: float
    """If no result moved before every push had arrived (a parameter server that pulls after it
    pushes): the busiest link of the push phase plus that of the result phase, plus the fill."""


def predict(policy: Policy, rates: Mapping[tuple[int, int], float], model_bytes: float, *,
            chunk_bytes: float = 4_000_000, routes: Routes | None = None) -> Prediction:
    """Predicted time of one synchronization of ``model_bytes`` under ``policy`` and ``rates``."""
    if model_bytes <= 0:
        raise PolicyError(f"model size must be positive, got {model_bytes} bytes")
    graph = RateGraph.from_rates(rates)
    routes = routes_for(graph) if routes is None else routes
    bulk, bottleneck = _busiest(link_loads(policy, graph, model_bytes, routes), graph)
    push_s, _ = _busiest(link_loads(policy, graph, model_bytes, routes, result=False), graph)
    result_s, _ = _busiest(link_loads(policy, graph, model_bytes, routes, push=False), graph)
    chunk_mbit = min(chunk_bytes, model_bytes) * 8 / 1e6
    fill = chunk_mbit * max(routed_delay(t, graph, routes) + routed_delay(t, graph, routes, down=True)
                            for t in policy.trees.values())
    return Prediction(bulk + fill, bulk, fill, bottleneck, push_s + result_s + fill)


def busiest_link_s(policy: Policy, rates: Mapping[tuple[int, int], float], model_bytes: float = 1.0) -> float:
    """Seconds the busiest link needs for ``policy`` at ``rates`` (the bulk term alone): what the
    scheduler compares when it asks whether rates or a new plan change the policy's pace."""
    graph = RateGraph.from_rates(rates)
    return _busiest(link_loads(policy, graph, model_bytes, routes_for(graph)), graph)[0]


def predict_sync_s(policy: Policy, rates: Mapping[tuple[int, int], float], model_bytes: float, *,
                   chunk_bytes: float = 4_000_000) -> float:
    """Predicted seconds for one synchronization (see ``predict``)."""
    return predict(policy, rates, model_bytes, chunk_bytes=chunk_bytes).total_s
