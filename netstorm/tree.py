"""An aggregation tree: gradients flow child -> parent up to the root, results flow back down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from netstorm.errors import PolicyError


@dataclass(frozen=True)
class Tree:
    """A spanning tree given by each node's parent (the root's parent is None)."""

    root: int
    parent: Mapping[int, int | None]

    def __post_init__(self) -> None:
        if self.parent.get(self.root, 0) is not None:
            raise PolicyError(f"tree rooted at {self.root}: the root must be a node with parent None")
        for node, up in self.parent.items():
            if up is None and node != self.root:
                raise PolicyError(f"tree rooted at {self.root}: node {node} has no parent")
            if up is not None and up not in self.parent:
                raise PolicyError(f"tree rooted at {self.root}: parent {up} of node {node} is not in the tree")
        # Every node must reach the root: depth computation fails on a cycle.
        _ = self._depth_map

    @classmethod
    def from_parents(cls, root: int, parent: Mapping[int, int | None], depth: Mapping[int, int]) -> Tree:
        """A tree whose shape the caller has already proven (parent closer to the root, ``depth`` exact)."""
        tree = object.__new__(cls)
        object.__setattr__(tree, "root", root)
        object.__setattr__(tree, "parent", parent)
        tree.__dict__["_depth_map"] = dict(depth)
        return tree

    @property
    def nodes(self) -> tuple[int, ...]:
        """All nodes, ascending."""
        return tuple(sorted(self.parent))

    def children(self, node: int) -> tuple[int, ...]:
        """Direct children of ``node``, ascending (looked up per chunk on the data path, so built once)."""
        return self._children.get(node, ())

    @cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        below: dict[int, list[int]] = {}
        for n, up in sorted(self.parent.items()):
            if up is not None:
                below.setdefault(up, []).append(n)
        return {up: tuple(kids) for up, kids in below.items()}

    def path_to_root(self, node: int) -> tuple[int, ...]:
        """``node``, its parent, ..., the root."""
        if node not in self.parent:
            raise PolicyError(f"node {node} is not in the tree rooted at {self.root}")
        path = [node]
        up = self.parent[node]
        while up is not None:
            path.append(up)
            up = self.parent[up]
        return tuple(path)

    def edges(self) -> tuple[tuple[int, int], ...]:
        """(child, parent) for every non-root node, ascending by child."""
        return tuple((n, up) for n, up in sorted(self.parent.items()) if up is not None)

    def depth(self) -> dict[int, int]:
        """Hops from every node to the root."""
        return dict(self._depth_map)

    def bottom_up(self) -> tuple[int, ...]:
        """Every node once, each child before its parent: deepest first, ties by ascending id."""
        depths = self._depth_map
        return tuple(sorted(depths, key=lambda n: (-depths[n], n)))

    @cached_property
    def _depth_map(self) -> dict[int, int]:
        depths: dict[int, int] = {self.root: 0}
        for start in sorted(self.parent):
            chain = []
            node = start
            while node not in depths:
                chain.append(node)
                if len(chain) > len(self.parent):
                    raise PolicyError(f"tree rooted at {self.root}: cycle through node {start}")
                up = self.parent[node]
                if up is None:
                    raise PolicyError(f"tree rooted at {self.root}: node {node} has no parent")
                node = up
            base = depths[node]
            for offset, n in enumerate(reversed(chain), start=1):
                depths[n] = base + offset
        return depths
