"""The WAN topologies (policy families): one registry that the policy's validation, the planner, the
scheduler and every command's ``--topology`` read.

An entry names its tree builder as ``"module:attribute"``, imported only when a policy is planned, so a
node validates a policy's topology without loading a solver. A builder takes ``(graph, rates, *,
num_roots, roots, hub, bkt_k)`` and returns ``(roots, trees, quality)`` (``netstorm.planning.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from netstorm.errors import PolicyError
from netstorm.registry import Registry


@dataclass(frozen=True)
class Topology:
    builder: str
    """``"module:attribute"`` of the tree builder."""
    summary: str
    """One line for the CLI's help and the docs."""
    rooted: bool = False
    """Its roots come from quality scores and stay fixed across re-plans (otherwise a re-plan keeps the
    first plan's hub)."""
    single_root: bool = False
    """Always one root, whatever ``num_root_servers`` says."""
    packs: bool = False
    """The LP tree packing (``tree_packing``) and planned offload apply to its trees."""


TOPOLOGIES: Registry[Topology] = Registry("topology", {
    "fapt": Topology("netstorm.planning.plan:fapt_trees", "multi-root FAPT (Algorithm 2; LP-packed by default)",
                     rooted=True, packs=True),
    "fapt1": Topology("netstorm.planning.plan:fapt_trees", "single-root FAPT", rooted=True, single_root=True),
    "star": Topology("netstorm.planning.plan:baseline_trees", "STAR at the hub with the smallest bound"),
    "star-mxnet": Topology("netstorm.planning.plan:baseline_trees", "STAR at the best-connected node (MXNet's)"),
    "bkt": Topology("netstorm.planning.plan:baseline_trees", "balanced k-ary tree at the best-connected node"),
    "mst": Topology("netstorm.planning.plan:baseline_trees", "maximum-throughput spanning tree at its fastest root"),
}, PolicyError)

NAMES = TOPOLOGIES.names
"""Every topology's name, the default first: the CLI's ``--topology`` choices and the wire's."""
