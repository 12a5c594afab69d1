"""``plan``: a policy from measured rates, for NetStorm's multi-root FAPT or one of the baselines.

Deterministic: the same rates give the same policy, byte for byte on the wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from netstorm import registry
from netstorm.errors import PolicyError
from netstorm.planning.auxpath import auxiliary_paths
from netstorm.planning.baselines import (
    best_bound_hub,
    best_connected,
    bkt_tree,
    maximum_spanning_edges,
    orient,
    star_tree,
)
from netstorm.planning.fapt import build_multi_root_fapt
from netstorm.planning.offload import plan_offload
from netstorm.planning.predict import busiest_link_s, routed_delay, routes_for
from netstorm.planning.rategraph import RateGraph
from netstorm.planning.rootpacking import pack_for_roots
from netstorm.policy import Policy, tree_pairs
from netstorm.scenario import Rates
from netstorm.topologies import TOPOLOGIES
from netstorm.tree import Tree

__all__ = ["FALLBACK_TOLERANCE", "baseline_trees", "fapt_trees", "plan", "simpler_alternatives"]

FALLBACK_TOLERANCE = 1e-9
"""Relative margin by which a simpler plan must be predicted faster before ``plan`` returns it (rounding
in the fluid model must not flip the choice)."""

Trees = tuple[tuple[int, ...], dict[int, Tree], dict[int, float]]
"""What a topology's builder returns: the roots, each root's tree, and the roots' quality q = 1 / w(T)."""


def _tree_edge_paths(graph: RateGraph, trees: Mapping[int, Tree]) -> dict[tuple[int, int], tuple[tuple[int, ...], ...]]:
    """For every directed pair the trees send on: the tree edge itself first, then Algorithm 3's paths
    in the graph without that link, each no faster than the one before.

    The tree edge leads because the runtime sends a chunk over it unless it is busy: a push child ->
    parent is the first hop of the child's fastest path to the root anyway, and a result returns down
    the same edge. An edge between DCs that share no link (STAR, BKT) is the IP route between them.
    """
    searched = auxiliary_paths(graph, tree_pairs(trees), without_direct=True)
    return {pair: (pair, *paths) for pair, paths in searched.items()}


def _baseline_tree(graph: RateGraph, rates: Rates, topology: str, hub: int | None, bkt_k: int) -> Tree:
    """At ``hub`` if given; else STAR at the hub with the smallest physical bound, ``star-mxnet`` and BKT
    at the best-connected node, MST at its fastest root."""
    if hub is not None and hub not in graph.index:
        raise PolicyError(f"hub {hub} is not a node of the overlay (nodes: {list(graph.nodes)})")
    if topology == "mst":
        edges = maximum_spanning_edges(graph)
        if hub is not None:
            return orient(graph.nodes, edges, hub)
        routes = routes_for(graph)
        options = [orient(graph.nodes, edges, r) for r in graph.nodes]
        return min(options, key=lambda t: (routed_delay(t, graph, routes), t.root))
    if hub is not None:
        root = hub
    elif topology == "star":
        root = best_bound_hub(rates)
    else:
        root = best_connected(graph)
    return star_tree(graph, root) if topology in ("star", "star-mxnet") else bkt_tree(graph, root, bkt_k)


def fapt_trees(graph: RateGraph, rates: Rates, topology: str, *, num_roots: int, roots: Sequence[int] | None,
               hub: int | None, bkt_k: int) -> Trees:
    """Algorithm 2's trees: the top ``num_roots`` roots (0 = every node; one for a ``single_root``
    topology), or the fixed ``roots`` of an earlier decision."""
    if TOPOLOGIES[topology].single_root:
        if roots is not None and len(roots) != 1:
            raise PolicyError(f"single-root FAPT takes one root, got {list(roots)}")
        num_roots = 1
    result = build_multi_root_fapt(graph, num_roots, roots)
    return result.roots, result.trees, result.quality


def baseline_trees(graph: RateGraph, rates: Rates, topology: str, *, num_roots: int, roots: Sequence[int] | None,
                   hub: int | None, bkt_k: int) -> Trees:
    """One baseline tree (``_baseline_tree``) and its quality."""
    tree = _baseline_tree(graph, rates, topology, hub, bkt_k)
    return (tree.root,), {tree.root: tree}, {tree.root: 1.0 / routed_delay(tree, graph, routes_for(graph))}


def plan(
    rates: Rates,
    *,
    topology: str = "fapt",
    num_roots: int = 0,
    roots: Sequence[int] | None = None,
    bkt_k: int = 2,
    hub: int | None = None,
    version: int = 0,
    aux: bool = True,
    packing: bool = True,
    offload: bool = False,
    fallback: bool = True,
) -> Policy:
    """A policy for the directed ``rates`` (Mbit/s for every overlay link).

    ``topology`` names a builder in ``netstorm.topologies`` (``fapt`` with ``num_roots`` or fixed ``roots``;
    the baselines at ``hub``). ``aux`` runs Algorithm 3 on every directed pair the trees send on,
    ``packing`` (Config.tree_packing) the LP tree packing for the same roots, and ``offload`` plans shares
    with the detours' fractions. ``fallback`` replaces a multi-root plan predicted slower than one of its
    roots' trees or STAR (``Policy.fallback`` says why). docs/ARCHITECTURE.md, *The WAN tier*.
    """
    entry = TOPOLOGIES.get_entry(topology)
    graph = RateGraph.from_rates(rates)
    build = registry.load(entry.builder)
    chosen, trees, quality = build(graph, rates, topology, num_roots=num_roots, roots=roots, hub=hub, bkt_k=bkt_k)
    packed = entry.packs and packing
    if packed:
        trees, share = pack_for_roots(graph, chosen, seeds=[trees[r] for r in chosen])
    else:
        total_q = sum(quality[r] for r in chosen)
        share = {r: quality[r] / total_q for r in chosen}
    why = ""
    if fallback and entry.rooted and len(chosen) > 1:
        # the fluid model needs each tree edge both ways; the paper's in-trees on a one-way overlay do not
        with contextlib.suppress(PolicyError):
            trees, share, why = _no_worse_than_simpler(graph, rates, topology, chosen, trees, share)
    aux_paths = _tree_edge_paths(graph, trees) if aux else {}
    # Built from validated rates by construction; from_wire is where untrusted policies are checked.
    planned = {(int(a), int(b)): float(rate) for (a, b), rate in rates.items()}
    moves: dict[tuple[int, int], tuple[tuple[tuple[int, ...], float], ...]] = {}
    if offload and aux and packed:
        share, moves = plan_offload(planned, trees, share, aux_paths)
    return Policy(version, topology, chosen, trees, share, quality, aux_paths, planned, offload=moves,
                  fallback=why)


def simpler_alternatives(graph: RateGraph, rates: Rates, trees: Mapping[int, Tree]) -> dict[str, Tree]:
    """The plans a multi-root one must not be predicted slower than: each of its roots' trees alone, and
    STAR at the hub with the smallest physical bound (every DC straight to one hub) when that hub is one of
    the roots."""
    out = {f"root {root} alone": tree for root, tree in sorted(trees.items())}
    hub = best_bound_hub(rates)
    if hub in trees:
        # STAR needs a link each way between the hub and every DC; an overlay without them has no STAR
        with contextlib.suppress(PolicyError):
            out[f"star at {hub}"] = star_tree(graph, hub)
    return out


def _no_worse_than_simpler(
    graph: RateGraph, rates: Rates, topology: str, chosen: tuple[int, ...], trees: dict[int, Tree],
    share: dict[int, float],
) -> tuple[dict[int, Tree], dict[int, float], str]:
    """The multi-root plan's trees and shares, or the simpler alternative predicted fastest when that is
    faster: every chunk to its root (the other roots keep their trees at share 0, so the root set, and a
    later re-plan's choice among them, stays what Algorithm 2 decided).

    Compared on the busiest link's seconds per byte (the bulk term of ``predict``, what the scheduler's
    re-plan rule compares), so the choice does not depend on the model's size. Algorithm 2's shares are
    proportional to quality, not to the links the trees share, so on some overlays several roots load one
    link more than a single root would.
    """
    def bulk(root_trees: Mapping[int, Tree], shares: Mapping[int, float]) -> float:
        return busiest_link_s(Policy(0, topology, chosen, root_trees, shares, dict.fromkeys(chosen, 1.0), {}), rates)

    def alone(tree: Tree) -> tuple[dict[int, Tree], dict[int, float]]:
        return {**trees, tree.root: tree}, {r: 1.0 if r == tree.root else 0.0 for r in chosen}

    multi = bulk(trees, share)
    name, tree = min(simpler_alternatives(graph, rates, trees).items(),
                     key=lambda item: (bulk(*alone(item[1])), item[0]))
    best = bulk(*alone(tree))
    if best >= multi * (1 - FALLBACK_TOLERANCE):
        return trees, share, ""
    note = (f"fell back to {name}: predicted {100 * (1 - best / multi):.1f} % faster than the "
            f"{len(chosen)}-root plan (busiest link); the other roots get no chunks")
    return (*alone(tree), note)
