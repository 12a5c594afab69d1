"""EINA: throughput-maximizing aggregation routing over edge aggregators (the MIQCP, corrected).

See docs/ARCHITECTURE.md, *Planning the tier inside a DC*."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from netstorm.planning import milp

EPS = 1e-6


@dataclass(frozen=True)
class Instance:
    aggregators: tuple[int, ...]
    workers: Mapping[int, int]
    """a_j: workers pinned to aggregator j."""
    roots: Mapping[int, int]
    """PS p -> its aggregator π[p]."""
    c: Mapping[int, float]
    b_in: Mapping[int, float]
    """b^I_j: what j can send into the fabric."""
    b_out: Mapping[int, float]
    """b^E_j: what j can receive from the fabric."""
    r_high: float
    r_low: float = 0.0
    depth: int = 3
    """d*: aggregators a flow may traverse, the root's included (d̂ = min(d*, |A|) - 1)."""
    duplex: frozenset[int] = frozenset()
    shared: tuple[tuple[frozenset[int], float], ...] = ()
    """Links several aggregators sit behind (a rack's uplink), with their capacity: every flow between an
    aggregator inside and one outside crosses it. Not in the paper, whose fabric is non-blocking."""

    def crossings(self, i: int, j: int) -> list[int]:
        """Indexes of the shared links a flow from i to j crosses."""
        return [k for k, (inside, _) in enumerate(self.shared) if (i in inside) != (j in inside)]

    @property
    def with_workers(self) -> list[int]:
        return [j for j in self.aggregators if self.workers.get(j, 0) > 0]

    @property
    def max_depth(self) -> int:
        return min(self.depth, len(self.aggregators)) - 1

    def bound(self) -> float:
        """Routing-independent upper bound on Σ r_p: min over worker aggregators of c_j / a_j (and r^U·|P|)."""
        return min([self.r_high * len(self.roots)] + [self.c[j] / self.workers[j] for j in self.with_workers])


@dataclass(frozen=True)
class Solution:
    rates: dict[int, float]
    trees: dict[int, dict[int, int]]
    """PS -> child aggregator -> parent aggregator."""
    method: str
    """``milp``, ``heuristic``, ``atp``, ``grid``..."""
    status: str
    seconds: float
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.rates.values())

    def shares(self) -> dict[int, float]:
        """PS -> r_p / Σ r (the MTREE rule)."""
        total = self.total
        return {p: (r / total if total > 0 else 1 / len(self.rates)) for p, r in self.rates.items()}


# --- the exact model ---------------------------------------------------------------------------------


PRINTED = ("root", "8", "10", "11")
"""The printed constraints ``solve_milp`` can keep instead of their corrections, one per defect:
``root`` (2)/(3): a PS's aggregator sends like any other, and must when it hosts workers; ``8``: (8) as
printed, no receive => forward; ``10``: (10) as typeset, a_j counted once per i != j; ``11``: (11) as
printed, Σ_p r_p <= b^I_j for every aggregator that roots no PS."""
LITERAL = frozenset({"root", "8", "11"})
"""``literal=True``: the printed model as the notes' check runs it (checks/eina_literal_model.py), (10)
and (12) read as intended."""


def solve_milp(inst: Instance, *, integer: bool = False, literal: bool = False,
               printed: frozenset[str] = frozenset(), time_limit: float | None = 60.0) -> Solution:
    """The corrected model solved by HiGHS, or with the ``printed`` constraints (names in ``PRINTED``;
    ``literal``: those of ``LITERAL``) kept as the paper prints them; status ``infeasible`` carries no
    trees."""
    unknown = set(printed) - set(PRINTED)
    if unknown:
        raise ValueError(f"no printed constraint {sorted(unknown)} (one of {', '.join(PRINTED)})")
    printed = frozenset(printed) | (LITERAL if literal else frozenset())
    A = list(inst.aggregators)
    P = list(inst.roots)
    AW = set(inst.with_workers)
    root = dict(inst.roots)
    M = len(A) + 1
    dh = inst.max_depth
    rU = inst.r_high
    m = milp.Model()
    r = {p: m.var(inst.r_low, rU, 1.0, integer=integer) for p in P}
    x: dict[tuple[int, int, int], int] = {}
    z: dict[tuple[int, int, int], int] = {}
    for p in P:
        for i in A:
            if i == root[p] and "root" not in printed:
                continue  # corrected: the root sends nothing
            for j in A:
                if i != j:
                    x[p, i, j] = m.var(0, 1, integer=True)
                    z[p, i, j] = m.var(0, rU)
                    m.row([(z[p, i, j], 1), (x[p, i, j], -rU)], ub=0)
                    m.row([(z[p, i, j], 1), (r[p], -1)], ub=0)
                    m.row([(z[p, i, j], 1), (r[p], -1), (x[p, i, j], -rU)], lb=-rU)
    d = {(p, i): m.var(0, 0 if i == root[p] else max(dh, 1), integer=True) for p in P for i in A}

    def out(p: int, i: int) -> list[tuple[int, float]]:
        return [(x[p, i, j], 1.0) for j in A if (p, i, j) in x]

    def into(p: int, i: int) -> list[tuple[int, float]]:
        return [(x[p, k, i], 1.0) for k in A if (p, k, i) in x]

    for p in P:
        for i in A:
            if i in AW and ("root" in printed or i != root[p]):
                m.row(out(p, i), 1, 1)                                               # (2)
            elif i != root[p] or "root" in printed:
                m.row(out(p, i), ub=1)                                               # (7)
                if "8" in printed:
                    m.row([*out(p, i), *((c, -M * v) for c, v in into(p, i))], ub=0)  # (8) as printed
                else:
                    m.row([*out(p, i), *((c, -v) for c, v in into(p, i))], ub=0)      # forward => receive
                    for k in A:
                        if (p, k, i) in x:                                           # receive => forward
                            m.row([(x[p, k, i], 1), *((c, -v) for c, v in out(p, i))], ub=0)
            for j in A:
                if (p, i, j) in x:                                                   # (5), (6)
                    m.row([(d[p, i], 1), (d[p, j], -1), (x[p, i, j], -M)], lb=1 - M)
                    m.row([(d[p, i], 1), (d[p, j], -1), (x[p, i, j], M)], ub=1 + M)
    roots = set(root.values())
    for j in A:
        zin = [(z[p, i, j], 1.0) for p in P for i in A if (p, i, j) in z]
        zout = [(z[p, j, k], 1.0) for p in P for k in A if (p, j, k) in z]
        a_j = float(inst.workers.get(j, 0)) * ((len(A) - 1) if "10" in printed else 1)
        m.row([*zin, *((r[p], a_j) for p in P)], ub=inst.c[j])                          # (10)
        m.row(zin, ub=inst.b_out[j])                                                    # (12), every j
        if "11" in printed:
            if j not in roots:
                m.row([(r[p], 1.0) for p in P], ub=inst.b_in[j])                       # (11) as printed
        else:
            m.row(zout, ub=inst.b_in[j])                                                # (11) corrected
            if j in inst.duplex:
                m.row([*zin, *zout], ub=inst.b_out[j])
    for k, (_, cap) in enumerate(inst.shared):
        m.row([(col, 1.0) for (p, i, j), col in z.items() if k in inst.crossings(i, j)], ub=cap)
    res = m.solve(time_limit=time_limit)
    detail = {"gap": res.gap}
    if res.values is None:
        return Solution({}, {}, "milp", res.status, res.seconds, detail)
    v = res.values
    rates = {p: max(0.0, v[r[p]]) for p in P}
    trees = {p: {i: j for (q, i, j), col in x.items() if q == p and v[col] > 0.5} for p in P}
    return Solution(rates, trees, "milp", res.status, res.seconds, detail)


# --- rates for fixed trees ---------------------------------------------------------------------------


def usage(inst: Instance, trees: Mapping[int, Mapping[int, int]]) -> dict[str, dict[int, dict[int, float]]]:
    """Per resource kind and aggregator: PS -> coefficient of r_p in its load, for these trees."""
    agg: dict[int, dict[int, float]] = {j: {} for j in inst.aggregators}
    rin: dict[int, dict[int, float]] = {j: {} for j in inst.aggregators}
    rout: dict[int, dict[int, float]] = {j: {} for j in inst.aggregators}
    for p, tree in trees.items():
        for j in inst.aggregators:
            agg[j][p] = float(inst.workers.get(j, 0))
        for child, parent in tree.items():
            agg[parent][p] = agg[parent].get(p, 0.0) + 1
            rin[parent][p] = rin[parent].get(p, 0.0) + 1
            rout[child][p] = rout[child].get(p, 0.0) + 1
    return {"c": agg, "in": rin, "out": rout}


def best_rates(inst: Instance, trees: Mapping[int, Mapping[int, int]], *, integer: bool = False) -> dict[int, float]:
    """With the trees fixed the rate problem is an LP (an ILP with integer rates)."""
    u = usage(inst, trees)
    m = milp.Model()
    r = {p: m.var(inst.r_low, inst.r_high, 1.0, integer=integer) for p in trees}
    for j in inst.aggregators:
        m.row([(r[p], k) for p, k in u["c"][j].items()], ub=inst.c[j])
        m.row([(r[p], k) for p, k in u["in"][j].items()], ub=inst.b_out[j])
        m.row([(r[p], k) for p, k in u["out"][j].items()], ub=inst.b_in[j])
        if j in inst.duplex:
            m.row([*((r[p], k) for p, k in u["in"][j].items()), *((r[p], k) for p, k in u["out"][j].items())],
                  ub=inst.b_out[j])
    for k, (_, cap) in enumerate(inst.shared):
        m.row([(r[p], 1.0) for p, tree in trees.items() for i, j in tree.items() if k in inst.crossings(i, j)],
              ub=cap)
    res = m.solve(time_limit=10.0)
    if res.values is None:
        return {p: 0.0 for p in trees}
    return {p: max(0.0, res.values[r[p]]) for p in trees}


def verify(inst: Instance, sol: Solution, eps: float = EPS) -> list[str]:
    """Problems of a plan against the corrected constraints (empty: feasible). Independent of the MILP."""
    problems: list[str] = []
    AW = set(inst.with_workers)
    use_c = {j: 0.0 for j in inst.aggregators}
    use_in = {j: 0.0 for j in inst.aggregators}
    use_out = {j: 0.0 for j in inst.aggregators}
    for p, rp in sol.rates.items():
        if rp > inst.r_high + eps or rp < inst.r_low - eps:
            problems.append(f"r_{p} = {rp} outside [{inst.r_low}, {inst.r_high}]")
        if rp <= eps:
            continue
        tree = sol.trees.get(p, {})
        root = inst.roots[p]
        if root in tree:
            problems.append(f"PS {p}: its root {root} sends")
        for j in AW - {root}:
            if j not in tree:
                problems.append(f"PS {p}: worker aggregator {j} sends nowhere")
        for v in tree:
            hops, u = 0, v
            while u != root:
                nxt = tree.get(u)
                hops += 1
                if nxt is None or hops > inst.max_depth:
                    problems.append(f"PS {p}: {v} does not reach the root within depth {inst.max_depth}")
                    break
                u = nxt
        kids: dict[int, int] = {}
        for parent in tree.values():
            kids[parent] = kids.get(parent, 0) + 1
        for j in inst.aggregators:
            if kids.get(j) and j not in tree and j != root:
                problems.append(f"PS {p}: {j} receives but does not forward")
            if j in tree or j == root or j in AW:
                use_c[j] += (kids.get(j, 0) + inst.workers.get(j, 0)) * rp
            use_in[j] += kids.get(j, 0) * rp
            if j in tree:
                use_out[j] += rp
    for k, (_, cap) in enumerate(inst.shared):
        load = sum(sol.rates.get(p, 0.0) for p, tree in sol.trees.items() if sol.rates.get(p, 0.0) > eps
                   for i, j in tree.items() if k in inst.crossings(i, j))
        if load > cap + eps:
            problems.append(f"shared link {k}: {load:.6g} > {cap:.6g}")
    for j in inst.aggregators:
        if use_c[j] > inst.c[j] + eps:
            problems.append(f"aggregator {j}: aggregation {use_c[j]:.6g} > c {inst.c[j]:.6g}")
        if use_in[j] > inst.b_out[j] + eps:
            problems.append(f"aggregator {j}: receives {use_in[j]:.6g} > b^E {inst.b_out[j]:.6g}")
        if use_out[j] > inst.b_in[j] + eps:
            problems.append(f"aggregator {j}: sends {use_out[j]:.6g} > b^I {inst.b_in[j]:.6g}")
        if j in inst.duplex and use_in[j] + use_out[j] > inst.b_out[j] + eps:
            problems.append(f"aggregator {j}: in + out {use_in[j] + use_out[j]:.6g} > {inst.b_out[j]:.6g}")
    return problems


# --- the solver-free heuristic ---------------------------------------------------------------------


def _build_tree(inst: Instance, root: int, r: float, c: Mapping[int, float], b_in: Mapping[int, float],
                b_out: Mapping[int, float]) -> dict[int, int] | None:
    """A depth-bounded tree for one PS at rate r on residual capacities, or None."""
    a = inst.workers
    dh = inst.max_depth

    def slots(j: int) -> int:
        by_c = math.floor((c[j] + 1e-9) / r) - a.get(j, 0)
        by_b = math.floor((b_out[j] + 1e-9) / r) - (1 if j in inst.duplex and j != root else 0)
        return max(0, min(by_c, by_b))

    if a.get(root, 0) * r > c[root] + 1e-9:
        return None
    must = [j for j in inst.with_workers if j != root]
    for j in must:
        if a[j] * r > c[j] + 1e-9 or b_in[j] < r - 1e-9:
            return None
        if j in inst.duplex and b_out[j] < r - 1e-9:
            return None
    relays = [j for j in inst.aggregators if j not in set(inst.with_workers) and j != root
              and b_in[j] >= r - 1e-9 and slots(j) >= 2]
    parent: dict[int, int] = {}
    level = [root]
    depth = 0
    pending = sorted(must, key=lambda j: (-slots(j), j))
    spare = sorted(relays, key=lambda j: (-slots(j), j))
    while pending:
        depth += 1
        if depth > dh:
            return None
        free = [(q, slots(q) - sum(1 for v in parent.values() if v == q)) for q in level]
        total = sum(s for _, s in free)
        if total <= 0:
            return None
        last = depth == dh
        if last and len(pending) > total:
            return None
        cands = sorted(pending + ([] if last else spare), key=lambda j: (-slots(j), j))[:total]
        holes = iter([q for q, s in free for _ in range(s)])
        for v in cands:
            parent[v] = next(holes)
            (pending if v in pending else spare).remove(v)
        level = cands
    changed = True
    while changed:  # relays that ended with no child go
        changed = False
        for v in list(parent):
            if v not in set(inst.with_workers) and v not in parent.values():
                del parent[v]
                changed = True
    return parent


def _take(inst: Instance, root: int, tree: Mapping[int, int], r: float, c: dict[int, float],
          b_in: dict[int, float], b_out: dict[int, float], sign: float = 1.0) -> None:
    """Subtract (``sign`` -1: give back) what ``tree`` at rate r uses from the residual capacities."""
    kids: dict[int, int] = {}
    for parent in tree.values():
        kids[parent] = kids.get(parent, 0) + 1
    for j in inst.aggregators:
        if j == root or j in tree:
            c[j] -= sign * (kids.get(j, 0) + inst.workers.get(j, 0)) * r
            b_out[j] -= sign * kids.get(j, 0) * r
        if j in tree:
            b_in[j] -= sign * r
            if j in inst.duplex:
                b_out[j] -= sign * r


def heuristic(inst: Instance, *, integer: bool = False) -> Solution:
    """Per PS in order of its root's downlink: bisection on the largest rate a tree exists for.

    With a floor r^L > 0 every PS first reserves a tree at r^L (in the same order), and each gives its
    reservation back only when its own bisection starts: a PS served early cannot take what a later
    one needs to stay in use (the printed objective alone would let it starve, defect 8)."""
    import time

    start = time.perf_counter()
    c, b_in, b_out = dict(inst.c), dict(inst.b_in), dict(inst.b_out)
    rates: dict[int, float] = {}
    trees: dict[int, dict[int, int]] = {}
    order = sorted(inst.roots, key=lambda p: (-inst.b_out[inst.roots[p]], p))
    lowest = math.ceil(inst.r_low - 1e-9) if integer else inst.r_low
    reserved: dict[int, dict[int, int]] = {}
    if lowest > 0:
        for p in order:
            t = _build_tree(inst, inst.roots[p], lowest, c, b_in, b_out)
            if t is None:
                return Solution({q: 0.0 for q in inst.roots}, {}, "heuristic",
                                f"no tree for PS {p} at r^L = {lowest:g}", time.perf_counter() - start)
            reserved[p] = t
            _take(inst, inst.roots[p], t, lowest, c, b_in, b_out)
    for p in order:
        root = inst.roots[p]
        best: tuple[float, dict[int, int]] | None = None
        if p in reserved:
            _take(inst, root, reserved[p], lowest, c, b_in, b_out, -1.0)
            best = (lowest, reserved[p])
        lo, hi = lowest, inst.r_high
        top = _build_tree(inst, root, hi, c, b_in, b_out)
        if top is not None:
            best = (hi, top)
        else:
            for _ in range(50):
                mid = (lo + hi) / 2
                if mid <= 1e-9:
                    break
                t = _build_tree(inst, root, mid, c, b_in, b_out)
                if t is not None:
                    lo, best = mid, (mid, t)
                else:
                    hi = mid
        if best is None:
            rates[p], trees[p] = 0.0, {}
            continue
        rp, tree = best
        if integer and not float(rp).is_integer():
            rp = float(math.floor(rp + 1e-9))
            t2 = _build_tree(inst, root, rp, c, b_in, b_out) if rp > 0 else None
            if t2 is None:
                rates[p], trees[p] = 0.0, {}
                continue
            tree = t2
        rates[p], trees[p] = rp, tree
        _take(inst, root, tree, rp, c, b_in, b_out)
    # with the trees fixed, the rates are an LP: the sequential split between PSs is re-balanced, and
    # shared links (which the trees were built without) are met
    if inst.shared:  # only PSs whose tree reaches every worker aggregator may get a rate
        served = {p: t for p, t in trees.items()
                  if all(j in t for j in inst.with_workers if j != inst.roots[p])}
        rates = {p: 0.0 for p in trees} | (best_rates(inst, served, integer=integer) if served else {})
    elif len(trees) > 1 and all(trees.values()):
        better = best_rates(inst, trees, integer=integer)
        if sum(better.values()) > sum(rates.values()) + 1e-9:
            rates = better
    return Solution(rates, trees, "heuristic", "heuristic", time.perf_counter() - start)


def solve(inst: Instance, *, integer: bool = False, time_limit: float = 60.0) -> Solution:
    """The MILP within ``time_limit``; the heuristic when it cannot prove the optimum in time (the better
    of the two when it has an incumbent)."""
    exact = solve_milp(inst, integer=integer, time_limit=time_limit)
    if exact.status == "optimal":
        return exact
    quick = heuristic(inst, integer=integer)
    if exact.rates and exact.total >= quick.total and not verify(inst, exact):
        return exact
    return Solution(quick.rates, quick.trees, "heuristic", f"milp {exact.status}; heuristic used",
                    exact.seconds + quick.seconds, {"milp_total": exact.total if exact.rates else math.nan})


# --- the paper's baselines at model level ----------------------------------------------------------


def atp(inst: Instance) -> Solution:
    """ATP: one aggregation at the local aggregator, then straight to the PS (its rates then the LP's)."""
    import time

    start = time.perf_counter()
    trees = {p: {j: root for j in inst.with_workers if j != root} for p, root in inst.roots.items()}
    rates = best_rates(inst, trees)
    return Solution(rates, trees, "atp", "optimal rates for star trees", time.perf_counter() - start)


def grid(inst: Instance, *, seed: int = 0) -> Solution:
    """GRID: single aggregation, a worker group may be aggregated at any aggregator or sent to the PS
    unaggregated; its relaxation (capacities of aggregation only, as GRID models them) at the largest
    common rate, randomized rounding, then rates that satisfy every constraint (the repair).

    The result is a ``Solution`` whose trees map group -> aggregation point (or the root: direct);
    ``grid_rates`` evaluates such an assignment, since unaggregated flows are not EINA trees.
    """
    import time

    start = time.perf_counter()
    rng = random.Random(seed)
    groups = inst.with_workers
    points = list(inst.aggregators)
    lo, hi = 0.0, inst.r_high
    best_y: dict[tuple[int, int, int], float] | None = None
    for _ in range(30):
        mid = (lo + hi) / 2
        y = _grid_relaxation(inst, groups, points, mid)
        if y is not None:
            lo, best_y = mid, y
        else:
            hi = mid
    assign: dict[int, dict[int, int]] = {}
    for p in inst.roots:
        assign[p] = {}
        for i in groups:
            if best_y is None:
                assign[p][i] = -1
                continue
            options = [(j, best_y.get((p, i, j), 0.0)) for j in [*points, -1]]
            total = sum(w for _, w in options)
            pick, acc, u = -1, 0.0, rng.random() * total
            for j, w in options:
                acc += w
                if u <= acc and w > 0:
                    pick = j
                    break
            assign[p][i] = pick
    rates = grid_rates(inst, assign)
    return Solution(rates, assign, "grid", "rounded and repaired", time.perf_counter() - start)


def _grid_relaxation(inst: Instance, groups: list[int], points: list[int],
                     rate: float) -> dict[tuple[int, int, int], float] | None:
    """Fractions y_{p,i,j} (j = -1: straight to the PS) with every group placed and aggregation
    capacities met at ``rate`` for every PS; None when infeasible."""
    m = milp.Model(maximize=False)
    y: dict[tuple[int, int, int], int] = {}
    for p in inst.roots:
        for i in groups:
            for j in [*points, -1]:
                closed = j not in (-1, i) and inst.b_out[j] <= 0  # takes no other aggregator's flows
                y[p, i, j] = m.var(0, 0 if closed else 1, 1.0 if j == -1 else 0.0)  # prefer aggregation
            m.row([(y[p, i, j], 1.0) for j in [*points, -1]], 1, 1)
    for j in points:
        m.row([(y[p, i, j], inst.workers[i] * rate) for p in inst.roots for i in groups], ub=inst.c[j])
    res = m.solve(time_limit=10.0)
    if res.values is None or res.status != "optimal":
        return None
    return {k: res.values[col] for k, col in y.items()}


def grid_rates(inst: Instance, assign: Mapping[int, Mapping[int, int]]) -> dict[int, float]:
    """Largest rates for a GRID assignment (group -> aggregation point, -1 unaggregated) under every
    constraint: aggregation, what each aggregator sends and receives, the shared links."""
    m = milp.Model()
    r = {p: m.var(inst.r_low, inst.r_high, 1.0) for p in assign}
    c: dict[int, list[tuple[int, float]]] = {j: [] for j in inst.aggregators}
    rin: dict[int, list[tuple[int, float]]] = {j: [] for j in inst.aggregators}
    rout: dict[int, list[tuple[int, float]]] = {j: [] for j in inst.aggregators}
    over: dict[int, list[tuple[int, float]]] = {k: [] for k in range(len(inst.shared))}

    def flow(i: int, j: int, term: tuple[int, float]) -> None:
        rout[i].append(term)
        rin[j].append(term)
        for k in inst.crossings(i, j):
            over[k].append(term)

    for p, groups in assign.items():
        root = inst.roots[p]
        aggregating: set[int] = set()
        for i, j in groups.items():
            a = float(inst.workers[i])
            if j == -1 or j == root:  # raw flows into the PS's aggregator
                if i != root:
                    flow(i, root, (r[p], a))
                if j == root:
                    c[root].append((r[p], a))
                continue
            c[j].append((r[p], a))
            if j != i:
                flow(i, j, (r[p], a))
            aggregating.add(j)
        for j in aggregating:  # one aggregate per aggregation point to the PS
            flow(j, root, (r[p], 1.0))
            c[root].append((r[p], 1.0))
    for j in inst.aggregators:
        m.row(c[j], ub=inst.c[j])
        m.row(rin[j], ub=inst.b_out[j])
        m.row(rout[j], ub=inst.b_in[j])
        if j in inst.duplex:
            m.row([*rin[j], *rout[j]], ub=inst.b_out[j])
    for k, (_, cap) in enumerate(inst.shared):
        m.row(over[k], ub=cap)
    res = m.solve(time_limit=10.0)
    if res.values is None:
        return {p: 0.0 for p in assign}
    return {p: max(0.0, res.values[r[p]]) for p in assign}


def random_instance(rng: random.Random, *, aggregators: int, pss: int, idle: int, workers: tuple[int, int],
                    capacity: tuple[float, float], depth: int = 5) -> Instance:
    """An instance in the paper's setting: PS aggregators first (no workers), then ``idle`` aggregators
    without workers, the rest with ``workers`` each; c, b^I, b^E uniform in ``capacity`` (Gbit/s)."""
    A = tuple(range(aggregators))
    roots = {p: p for p in range(pss)}
    a = {j: (rng.randint(*workers) if j >= pss + idle else 0) for j in A}
    c = {j: rng.uniform(*capacity) for j in A}
    b_in = {j: rng.uniform(*capacity) for j in A}
    b_out = {j: rng.uniform(*capacity) for j in A}
    return Instance(A, a, roots, c, b_in, b_out, r_high=capacity[1], depth=depth)
