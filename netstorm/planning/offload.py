"""Planned offload: chunk shares and the part of each tree link's chunks auxiliary paths carry, together.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
from scipy.optimize import linprog

from netstorm.tree import Tree

Path = tuple[int, ...]
Link = tuple[int, int]
Offload = dict[Link, tuple[tuple[Path, float], ...]]

OFFLOAD_MIN_GAIN = 0.1
"""Smallest relative drop of the busiest link's time worth offloading for."""
MIN_FRACTION = 0.01
"""Moves below this fraction of a link's chunks are dropped (less than one chunk in a hundred)."""
HOP_PENALTY = 1e-3
"""Objective weight of the load moved, per hop of its path, against T in units of the trees' own."""


def tree_links(tree: Tree) -> list[Link]:
    """The directed links a tree sends on: each edge up (push) and down (result)."""
    return [link for child, parent in tree.edges() for link in ((child, parent), (parent, child))]


def tree_loads(trees: Mapping[int, Tree], share: Mapping[int, float]) -> dict[Link, float]:
    """Fraction of the model each directed link carries under the trees."""
    loads: dict[Link, float] = {}
    for root, tree in trees.items():
        for link in tree_links(tree):
            loads[link] = loads.get(link, 0.0) + share[root]
    return loads


def busiest(loads: Mapping[Link, float], rates: Mapping[Link, float]) -> float:
    """The busiest link's load / rate."""
    return max((load / rates[link] for link, load in loads.items() if load > 0), default=0.0)


def plan_offload(rates: Mapping[Link, float], trees: Mapping[int, Tree], share: Mapping[int, float],
                 aux_paths: Mapping[Link, tuple[Path, ...]], *, min_gain: float = OFFLOAD_MIN_GAIN,
                 fixed_shares: bool = False) -> tuple[dict[int, float], Offload]:
    """New shares for the roots and, per directed tree link, (auxiliary path, fraction of the link's
    chunks); ``share`` and no moves when offloading does not gain ``min_gain``.

    ``fixed_shares`` keeps ``share`` and plans the moves alone: an iteration already bound to a policy
    keeps its chunks' roots, but its senders can still follow moves planned for rates that changed under
    it, which recovers most of what the old trees lose under the new rates."""
    unchanged: tuple[dict[int, float], Offload] = (dict(share), {})
    links = sorted(rates)
    index = {link: i for i, link in enumerate(links)}
    roots = sorted(trees)
    sends = np.zeros((len(links), len(roots)))
    for j, root in enumerate(roots):
        for link in tree_links(trees[root]):
            if link not in index:
                return unchanged  # a tree edge off the overlay rides an IP route: not planned here
            sends[index[link], j] += 1.0
    used = [link for link in links if sends[index[link]].any()]
    columns = [(link, path) for link in used for path in aux_paths.get(link, ())[1:]
               if len(path) > 2 and all(hop in index for hop in itertools.pairwise(path))]
    if not columns:
        return unchanged
    base_t = busiest(tree_loads(trees, share), rates)
    # Variables: t (T in units of base_t), s per root, z per column.
    n_s, n = len(roots), 1 + len(roots) + len(columns)
    row_of = {link: len(links) + k for k, link in enumerate(used)}
    a_ub = np.zeros((len(links) + len(used), n))
    for i, link in enumerate(links):
        a_ub[i, 0] = -rates[link] * base_t
        a_ub[i, 1:1 + n_s] = sends[i]
    for link in used:
        a_ub[row_of[link], 1:1 + n_s] = -sends[index[link]]
    cost = np.zeros(n)
    cost[0] = 1.0
    for j, (link, path) in enumerate(columns, start=1 + n_s):
        a_ub[index[link], j] -= 1.0
        for hop in itertools.pairwise(path):
            a_ub[index[hop], j] += 1.0
        a_ub[row_of[link], j] = 1.0
        cost[j] = HOP_PENALTY * (len(path) - 1)
    a_eq = np.zeros((1, n))
    a_eq[0, 1:1 + n_s] = 1.0
    bounds: list[tuple[float, float | None]] = [(0.0, None)] * n
    if fixed_shares:
        bounds[1:1 + n_s] = [(share[root], share[root]) for root in roots]
    result = linprog(cost, A_ub=a_ub, b_ub=np.zeros(len(a_ub)), A_eq=a_eq, b_eq=[1.0],
                     bounds=bounds, method="highs")
    if result.status != 0 or result.x[0] > 1 - min_gain:
        return unchanged
    raw = np.clip(result.x[1:1 + n_s], 0.0, None)
    shares = dict(share) if fixed_shares else \
        {root: float(v) for root, v in zip(roots, raw / raw.sum(), strict=True)}
    loads = tree_loads(trees, shares)
    moves: dict[Link, list[tuple[Path, float]]] = {}
    for (link, path), z in zip(columns, result.x[1 + n_s:], strict=True):
        fraction = min(1.0, float(z) / loads[link]) if loads.get(link, 0.0) > 0 else 0.0
        if fraction >= MIN_FRACTION:
            moves.setdefault(link, []).append((path, fraction))
    for link, paths in moves.items():  # rounding must not move more than the link carries
        total = sum(f for _, f in paths)
        if total > 1.0:
            moves[link] = [(p, f / total) for p, f in paths]
    return shares, {link: tuple(paths) for link, paths in moves.items()}
