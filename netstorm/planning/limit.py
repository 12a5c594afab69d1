"""The physical limit of one synchronization: M / λ, λ the directed min cut of the rate graph.

Every nonempty proper node set S holds gradients the rest needs and needs results the rest holds, so
at least the model's size must leave S (partial sums towards roots outside, results towards nodes
outside) over links whose rates add up to the cut capacity out of S. The smallest such capacity over
all S is λ, and no scheme -- tree, ring or anything else -- finishes faster than M / λ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx

from netstorm.errors import PolicyError
from netstorm.planning.rategraph import RateGraph


@dataclass(frozen=True)
class MinCut:
    """The directed min cut: capacity in Mbit/s out of ``source_side`` into the other nodes."""

    mbit: float
    source_side: frozenset[int]
    sink_side: frozenset[int]


def min_cut(rates: Mapping[tuple[int, int], float]) -> MinCut:
    """λ = min over nonempty proper S of the rate leaving S.

    Fix any node v. A cut S either contains v (then some t is outside) or not (then some t is inside),
    so λ is the smallest of the 2(n-1) max-flows v -> t and t -> v. Ties go to the first found, in
    ascending t, v -> t before t -> v.
    """
    graph = RateGraph.from_rates(rates)
    if graph.n < 2:
        raise PolicyError("a min cut needs at least two nodes")
    flow_graph = nx.DiGraph()
    flow_graph.add_nodes_from(graph.nodes)
    for a, b, s in zip(graph.src.tolist(), graph.dst.tolist(), graph.rate.tolist(), strict=True):
        flow_graph.add_edge(graph.nodes[a], graph.nodes[b], capacity=s)
    anchor = graph.nodes[0]
    best: MinCut | None = None
    for other in graph.nodes[1:]:
        for source, sink in ((anchor, other), (other, anchor)):
            _, (side, rest) = nx.minimum_cut(flow_graph, source, sink)
            # Recompute from the partition: exact in the rates' own floats, not the solver's.
            capacity = math.fsum(s for (a, b), s in sorted(rates.items()) if a in side and b not in side)
            if best is None or capacity < best.mbit:
                best = MinCut(float(capacity), frozenset(side), frozenset(rest))
    assert best is not None
    return best


def limit_s(model_bytes: float, rates: Mapping[tuple[int, int], float]) -> float:
    """Seconds below which no synchronization of ``model_bytes`` can finish: M·8 / (λ·10^6)."""
    if model_bytes <= 0:
        raise PolicyError(f"model size must be positive, got {model_bytes} bytes")
    return model_bytes * 8 / (min_cut(rates).mbit * 1e6)
