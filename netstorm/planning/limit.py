"""The physical limit of one synchronization: M / λ, λ the directed min cut of the rate graph.

Every nonempty proper node set S holds gradients the rest needs and needs results the rest holds, so
at least the model's size must leave S (partial sums towards roots outside, results towards nodes
outside) over links whose rates add up to the cut capacity out of S. The smallest such capacity over
all S is λ, and no scheme -- tree, ring or anything else -- finishes faster than M / λ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True)
class RateSegment:
    """Rates (Mbit/s per directed link) in force from ``start`` until the next segment's start."""

    start: float
    rates: Mapping[tuple[int, int], float]


def _in_force(segments: Sequence[RateSegment], start: float) -> list[RateSegment]:
    """The segments from ``start`` on, the first cut to begin at ``start`` (the earliest one's rates when
    ``start`` precedes every segment)."""
    if not segments:
        raise PolicyError("a window limit needs at least one rate segment")
    ordered = sorted(segments, key=lambda s: s.start)
    current = ordered[0]
    for seg in ordered:
        if seg.start <= start:
            current = seg
    return [RateSegment(start, current.rates), *(s for s in ordered if s.start > start)]


def _cut_of(totals: Mapping[tuple[int, int], float], side: frozenset[int]) -> float:
    return math.fsum(v for (a, b), v in totals.items() if a in side and b not in side)


def window_limit_s(model_bytes: float, segments: Sequence[RateSegment], start: float) -> float:
    """The least T in which ``model_bytes`` can leave every cut, from ``start`` on, at piecewise constant rates.

    A cut S's capacity over [start, start + T] is C_S(T), the integral of the rates of the links leaving
    it, so no synchronization started at ``start`` ends before every C_S has carried M: T is the time at
    which f(T) = min_S C_S(T), the min cut of the integrated rate graph (the rates averaged over the
    window, times T), reaches M. While one set of rates holds this is M/λ. Across a re-draw neither set's
    M/λ is a bound: held to the new rates, an iteration that ran mostly on faster old ones would beat its
    limit, and when the old min cut's links speed up as the new min cut's slow down, no cut is slow
    throughout and T is below both.

    f is concave and piecewise linear, so Newton's step from below is exact: at T, the min cut S of the
    integrated graph gives the line C_S(T) + r_S·t, whose crossing of M is still no later than the answer
    (f lies below every such line), and each step either reaches M or moves to a new cut.
    """
    if model_bytes <= 0:
        raise PolicyError(f"model size must be positive, got {model_bytes} bytes")
    need = model_bytes * 8 / 1e6  # Mbit
    window = _in_force(segments, start)
    totals: dict[tuple[int, int], float] = {}
    for k, seg in enumerate(window):
        end = window[k + 1].start if k + 1 < len(window) else math.inf
        rates = dict(seg.rates)
        if end < math.inf:
            at_end = {link: totals.get(link, 0.0) + rate * (end - seg.start) for link, rate in rates.items()}
            if min_cut(at_end).mbit < need:
                totals = at_end
                continue
        # M is reached inside this segment; start Newton from a point no later than the answer: f(t) is
        # at most f(seg.start) + (t - seg.start) · (every link's rate summed).
        base = min_cut(totals).mbit if totals else 0.0
        t = (need - base) / math.fsum(rates.values())
        for _ in range(10 * len(rates) + 10):
            graph = {link: totals.get(link, 0.0) + rate * t for link, rate in rates.items()}
            cut = min_cut(graph)
            if cut.mbit >= need * (1 - 1e-12):
                return seg.start + t - start
            slope = _cut_of(rates, cut.source_side)
            if slope <= 0:
                raise PolicyError("a cut carries nothing in this segment, yet the segment reaches M")
            t += (need - cut.mbit) / slope
        raise PolicyError("window limit: Newton's method did not settle")  # pragma: no cover
    raise AssertionError("unreachable: the last segment is unbounded")  # pragma: no cover
