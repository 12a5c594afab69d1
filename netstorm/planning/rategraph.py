"""The directed rate graph every policy algorithm works on.

Node ids are sorted once and edges kept in (src, dst) order, so the arrays -- and every result derived
from them -- do not depend on the order a caller's rate dict was filled in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from netstorm.errors import PolicyError


@dataclass(frozen=True, eq=False)
class RateGraph:
    """Directed links with rates s(e) in Mbit/s and transfer delays w_trans(e) = 1 / s(e)."""

    nodes: tuple[int, ...]
    """Node ids, ascending; position = index into every array."""
    src: np.ndarray
    """Edge tails (indices), edges sorted by (src, dst)."""
    dst: np.ndarray
    rate: np.ndarray
    """Mbit/s per edge."""
    index: dict[int, int] = field(repr=False)

    @classmethod
    def from_rates(cls, rates: Mapping[tuple[int, int], float], nodes: Iterable[int] | None = None) -> RateGraph:
        """Validate ``rates`` (positive, finite, no self-links) and index them."""
        node_set: set[int] = set(nodes) if nodes is not None else set()
        items = []
        for key, value in rates.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise PolicyError(f"rate key {key!r} is not a (src, dst) pair")
            a, b = key
            if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
                raise PolicyError(f"rate key {key!r}: node ids must be integers")
            if a == b:
                raise PolicyError(f"rate {a}->{b}: a link from a node to itself")
            try:
                s = float(value)
            except (TypeError, ValueError):
                raise PolicyError(f"rate {a}->{b}: not a number: {value!r}") from None
            if not math.isfinite(s) or s <= 0:
                raise PolicyError(f"rate {a}->{b}: must be positive and finite, got {value!r}")
            items.append((a, b, s))
            node_set.update((a, b))
        if not node_set:
            raise PolicyError("no nodes: the rate map is empty")
        ordered = tuple(sorted(node_set))
        index = {n: i for i, n in enumerate(ordered)}
        items.sort()
        src = np.array([index[a] for a, _, _ in items], dtype=np.int64)
        dst = np.array([index[b] for _, b, _ in items], dtype=np.int64)
        rate = np.array([s for _, _, s in items], dtype=np.float64)
        return cls(ordered, src, dst, rate, index)

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def weight(self) -> np.ndarray:
        """w_trans per edge: seconds per Mbit."""
        return 1.0 / self.rate

    def matrix(self, *, transpose: bool = False) -> csr_matrix:
        """Sparse n x n matrix of w_trans (row = tail unless ``transpose``)."""
        rows, cols = (self.dst, self.src) if transpose else (self.src, self.dst)
        return csr_matrix((self.weight, (rows, cols)), shape=(self.n, self.n))

    @cached_property
    def distances_to(self) -> np.ndarray:
        """D[r, v] = cost of the fastest path from node index v to node index r (inf if none).

        Shortest paths *to* r are shortest paths *from* r in the reversed graph. Computed once per
        graph: Algorithm 1 and Algorithm 3's search heuristic both need it.
        """
        result: np.ndarray = dijkstra(self.matrix(transpose=True), directed=True)
        return result

    def has_distances(self) -> bool:
        """Whether ``distances_to`` is already computed."""
        return "distances_to" in self.__dict__

    def rate_of(self, a: int, b: int) -> float:
        """s(a -> b) in Mbit/s; PolicyError when the overlay has no such link."""
        i, j = self.index.get(a), self.index.get(b)
        if i is not None and j is not None:
            lo = int(np.searchsorted(self.src, i, side="left"))
            hi = int(np.searchsorted(self.src, i, side="right"))
            k = lo + int(np.searchsorted(self.dst[lo:hi], j))
            if k < hi and self.dst[k] == j:
                return float(self.rate[k])
        raise PolicyError(f"no overlay link {a}->{b}")

    def out_neighbors(self) -> list[list[tuple[int, float]]]:
        """Per node index, (head index, w_trans) of its out-links in ascending head order."""
        adjacency: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        for a, b, w in zip(self.src.tolist(), self.dst.tolist(), self.weight.tolist(), strict=True):
            adjacency[a].append((b, w))
        return adjacency

    def undirected_edges(self) -> list[tuple[int, int]]:
        """Node-id pairs (a < b) joined by a link in at least one direction."""
        pairs = {(min(a, b), max(a, b)) for a, b in zip(self.src.tolist(), self.dst.tolist(), strict=True)}
        return [(self.nodes[a], self.nodes[b]) for a, b in sorted(pairs)]
