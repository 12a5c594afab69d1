"""Policies: the trees, chunk shares and auxiliary paths a scheduler hands every node.

A Policy is pure data with an exact wire form. ``netstorm.planning.plan`` makes one from measured
rates; this module imports no planner, so a node can read a policy without loading the solvers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from netstorm import policywire
from netstorm.errors import PolicyError
from netstorm.policywire import WIRE_VERSION
from netstorm.topologies import NAMES as TOPOLOGIES
from netstorm.tree import Tree

__all__ = ["TOPOLOGIES", "WIRE_VERSION", "Policy", "PolicyError", "Tree", "tree_pairs"]


@dataclass(frozen=True)
class Policy:
    """One decision of the scheduler: every root's tree, its share of the chunks, the auxiliary paths."""

    version: int
    topology: str
    roots: tuple[int, ...]
    trees: Mapping[int, Tree]
    chunk_share: Mapping[int, float]
    """Root -> fraction of the model's elements it aggregates; sums to 1."""
    quality: Mapping[int, float]
    """q_i = 1 / w(T_i) for the roots (for every node on a first FAPT decision)."""
    aux_paths: Mapping[tuple[int, int], tuple[tuple[int, ...], ...]]
    """(src, dst) -> Algorithm 3's paths, [0] the primary."""
    rates: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    """Directed link -> the rate (Mbit/s) this policy was planned with: a sender compares what its
    links deliver against it to tell when the plan no longer holds (empty: unknown)."""
    explore: frozenset[tuple[int, int]] = frozenset()
    """Directed links the scheduler has no measurement of since the network last changed and no tree
    uses: their senders route a few chunks per iteration over auxiliary paths through them, so they are
    measured (the trees alone would never measure them, and a plan keeps avoiding a link believed slow)."""
    offload: Mapping[tuple[int, int], tuple[tuple[tuple[int, ...], float], ...]] = dataclasses.field(
        default_factory=dict)
    """Directed tree link -> (auxiliary path, fraction of the chunks it sends on that link), planned
    (``netstorm.planning.offload``): what the trees alone cannot balance."""
    fallback: str = dataclasses.field(default="", compare=False)
    """Why the planner returned a simpler plan than the one asked for (a multi-root FAPT predicted slower
    than one of its roots alone, or than STAR); empty: it did not. The planner's account, not the wire's."""

    @property
    def nodes(self) -> tuple[int, ...]:
        return self.trees[self.roots[0]].nodes

    def tree_links(self) -> frozenset[tuple[int, int]]:
        """Directed links the trees send on: every edge, up (push) and down (result), of the trees whose
        root has a share of the chunks (the tree of a root without one carries nothing)."""
        return frozenset(tree_pairs({r: t for r, t in self.trees.items() if self.chunk_share[r] > 0}))

    def with_version(self, version: int) -> Policy:
        return dataclasses.replace(self, version=version)

    def validate(self) -> None:
        """Raise PolicyError unless every invariant the runtime relies on holds."""
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise PolicyError(f"policy version must be a non-negative integer, got {self.version!r}")
        if self.topology not in TOPOLOGIES:
            raise PolicyError(f"unknown topology {self.topology!r} (known: {', '.join(TOPOLOGIES)})")
        if not self.roots or len(set(self.roots)) != len(self.roots):
            raise PolicyError(f"roots must be non-empty and distinct, got {list(self.roots)}")
        if set(self.trees) != set(self.roots):
            raise PolicyError(f"trees {sorted(self.trees)} do not match roots {sorted(self.roots)}")
        nodes = set(self.trees[self.roots[0]].parent)
        for root in self.roots:
            tree = self.trees[root]
            if tree.root != root:
                raise PolicyError(f"tree under root {root} is rooted at {tree.root}")
            if set(tree.parent) != nodes:
                raise PolicyError(f"tree of root {root} does not span the same nodes as the others")
        if set(self.chunk_share) != set(self.roots):
            raise PolicyError(f"chunk shares {sorted(self.chunk_share)} do not match roots {sorted(self.roots)}")
        for root, share in self.chunk_share.items():
            if not (isinstance(share, float) and math.isfinite(share) and share >= 0):
                raise PolicyError(f"chunk share of root {root} must be a non-negative float, got {share!r}")
        if not math.isclose(sum(self.chunk_share.values()), 1.0, rel_tol=0, abs_tol=1e-9):
            raise PolicyError(f"chunk shares sum to {sum(self.chunk_share.values())}, not 1")
        for node, q in self.quality.items():
            if node not in nodes or not (isinstance(q, float) and q > 0 and not math.isnan(q)):
                raise PolicyError(f"quality of node {node} must be a positive float of a tree node, got {q!r}")
        for (src, dst), paths in self.aux_paths.items():
            if src not in nodes or dst not in nodes or src == dst:
                raise PolicyError(f"auxiliary paths {src}->{dst}: endpoints must be two distinct tree nodes")
            for path in paths:
                if len(path) < 2 or path[0] != src or path[-1] != dst or len(set(path)) != len(path):
                    raise PolicyError(f"auxiliary path {list(path)} is not a simple path {src}->{dst}")
                if any(n not in nodes for n in path):
                    raise PolicyError(f"auxiliary path {list(path)} leaves the tree's nodes")
        for (src, dst), rate in self.rates.items():
            if src == dst or not (isinstance(rate, float) and math.isfinite(rate) and rate > 0):
                raise PolicyError(f"planned rate of link {src}->{dst} must be a positive float "
                                  f"between two nodes, got {rate!r}")
        for src, dst in self.explore:
            if src == dst or src not in nodes or dst not in nodes:
                raise PolicyError(f"link {src}->{dst} to explore must join two distinct tree nodes")
        for (src, dst), moves in self.offload.items():
            for path, fraction in moves:
                if (len(path) < 3 or path[0] != src or path[-1] != dst or len(set(path)) != len(path)
                        or any(n not in nodes for n in path)):
                    raise PolicyError(f"offload path {list(path)} of {src}->{dst} is not a simple detour "
                                      f"between tree nodes")
                if not (isinstance(fraction, float) and 0 < fraction <= 1):
                    raise PolicyError(f"offload fraction of {src}->{dst} must be in (0, 1], got {fraction!r}")
            if sum(f for _, f in moves) > 1 + 1e-9:
                raise PolicyError(f"offload fractions of {src}->{dst} sum above 1")

    def to_wire(self) -> dict[str, Any]:
        """A msgpack/JSON-safe dict (string keys, node ids as decimal strings); exact round trip."""
        return {
            "wire": WIRE_VERSION,
            "version": self.version,
            "topology": self.topology,
            "roots": list(self.roots),
            "trees": {str(r): {str(n): p for n, p in sorted(self.trees[r].parent.items())} for r in self.roots},
            "chunk_share": {str(r): self.chunk_share[r] for r in self.roots},
            "quality": {str(n): q for n, q in sorted(self.quality.items())},
            "aux_paths": {f"{s}->{d}": [list(p) for p in paths] for (s, d), paths in sorted(self.aux_paths.items())},
            # Optional: left off when empty, so builds that predate it read this policy.
            **({"rates": {f"{s}->{d}": r for (s, d), r in sorted(self.rates.items())}} if self.rates else {}),
            **({"explore": [f"{s}->{d}" for s, d in sorted(self.explore)]} if self.explore else {}),
            **({"offload": {f"{s}->{d}": [[list(p), f] for p, f in moves]
                            for (s, d), moves in sorted(self.offload.items())}} if self.offload else {}),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Policy:
        """Decode ``to_wire``'s form; anything malformed or unknown raises PolicyError."""
        form = policywire.parse(data)
        trees = {root: Tree(root, parent) for root, parent in form.trees.items()}
        aux = {policywire.link(key): paths for key, paths in form.aux_paths.items()}
        rates = {policywire.link(key): float(rate) for key, rate in form.rates.items()}
        explore = frozenset(policywire.link(key) for key in form.explore)
        offload = {policywire.link(key): tuple((path, float(f)) for path, f in moves)
                   for key, moves in form.offload.items()}
        policy = cls(form.version, form.topology, form.roots, trees,
                     {r: float(v) for r, v in form.chunk_share.items()},
                     {n: float(q) for n, q in form.quality.items()}, aux, rates, explore, offload)
        policy.validate()
        return policy


def tree_pairs(trees: Mapping[int, Tree]) -> set[tuple[int, int]]:
    """Directed pairs a policy sends on: every tree edge up (push) and down (result)."""
    up = {(child, parent) for tree in trees.values() for child, parent in tree.parent.items() if parent is not None}
    return up | {(parent, child) for child, parent in up}
