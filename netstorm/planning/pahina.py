"""PAHInA's precision-aware assignment: a priority-ordered greedy with per-(aggregator, precision)
capacity (Algorithm 1), then the weighted rate allocation (Stage 2, Eq. 2).

See docs/ARCHITECTURE.md, *Planning the tier inside a DC*."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from netstorm.lan_scenario import LanSpec, LanWorker
from netstorm.planning.lanmodel import GATEWAY, PRECISION_SCALE, DcPlan, Node, flat, make_plan, merge, predict, tor_id

W_SIZE = 0.5
W_COST = 0.5
R_EST_FRACTION = 1.0
R_EST_LADDER = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
"""r_est as multiples of the flat gateway's fp32 rate. The paper leaves r_est "a configurable parameter
... a fraction of the average worker's access link bandwidth"; Stage 1 admits members until r_est
fills an aggregator, so the plan's rate ends near r_est: each multiple is tried and the assignment
whose Stage 2 rate is best is kept (the baseline gets the same ladder)."""


@dataclass(frozen=True)
class _Candidate:
    node: Node
    rate_up: float
    """Rate of its path to the gateway (for the inflation term)."""


def _port(w: LanWorker) -> float:
    return min(w.up_gbit, w.down_gbit)


def _uplink(lan: LanSpec, rack: int | None) -> float:
    return lan.rack(rack).uplink_gbit if rack is not None and lan.racks else float("inf")


def path_rate(lan: LanSpec, w: LanWorker, node: Node) -> float:
    """Bottleneck rate from worker ``w`` to ``node``."""
    rate = _port(w)
    if node == GATEWAY:
        return min(rate, _uplink(lan, w.rack), lan.gateway_gbit)
    if isinstance(node, int):
        v = lan.workers[node]
        if v.rack != w.rack:
            rate = min(rate, _uplink(lan, w.rack), _uplink(lan, v.rack))
        return min(rate, _port(v))
    rack = int(str(node)[4:])
    if rack != w.rack:
        rate = min(rate, _uplink(lan, w.rack), _uplink(lan, rack))
    return rate


def capacity(lan: LanSpec, node: Node, precision: str) -> float:
    if isinstance(node, int):
        v = lan.workers[node]
        return v.agg_gbit if v.agg_gbit is not None else _port(v)
    return lan.rack(int(str(node)[4:])).capacity(precision)


def assign(lan: LanSpec, *, aware: bool = True, inflation: bool = True, w_size: float = W_SIZE,
           w_cost: float = W_COST, r_est_fraction: float = R_EST_FRACTION,
           tor: bool = True) -> tuple[dict[Node, Node], list[str]]:
    """Algorithm 1 (``aware``) or its precision-oblivious form; the tree and notes on degradations."""
    notes: list[str] = []
    workers = list(lan.workers)
    prec = {w.index: (w.precision if aware else "fp32") for w in workers}
    r_est = predict(lan, flat(lan)).seconds_per_gbit ** -1 * r_est_fraction
    if lan.racks and tor:
        nodes: list[Node] = [tor_id(r.id) for r in lan.racks]
    else:
        nodes = [w.index for w in workers]
        why = "no racks" if not lan.racks else "no ToR aggregators"
        notes.append(f"{why}: workers are the programmable nodes (two levels, XDP on the aggregator)")
    cost = {w.index: 1 / max(path_rate(lan, w, v) for v in [*nodes, GATEWAY] if v != w.index) for w in workers}
    size = {w.index: PRECISION_SCALE[prec[w.index]] for w in workers}

    def norm(values: Mapping[int, float]) -> dict[int, float]:
        lo, hi = min(values.values()), max(values.values())
        return {k: (v - lo) / (hi - lo) if hi > lo else 0.0 for k, v in values.items()}

    ns, nc = norm(size), norm(cost)
    priority = {w.index: (w_size if aware else 0.0) * ns[w.index] + w_cost * nc[w.index] for w in workers}
    order = sorted(workers, key=lambda w: (-priority[w.index], w.index))
    used: dict[tuple[Node, str], float] = {}
    lanes: dict[Node, set[str]] = {}
    parent: dict[Node, Node] = {}
    aggregating: set[int] = set()

    def pools(v: Node, p: str) -> list[tuple[tuple[Node, str], float]]:
        """The capacities a ``p`` input at v draws on: a worker's one port or XDP budget; a rack's
        per-precision capacity, and its total when it lists none per precision."""
        if isinstance(v, int):
            return [((v, "*"), capacity(lan, v, p))]
        rack = lan.rack(int(str(v)[4:]))
        out: list[tuple[tuple[Node, str], float]] = [((v, p), rack.capacity(p))]
        if not rack.precision_gbit:
            out.append(((v, "*"), rack.aggregator_gbit))
        return out

    def fits(v: Node, p: str, charge: float) -> bool:
        if isinstance(v, int):  # a worker's port carries its children's flows and its own aggregate
            inputs = sum(PRECISION_SCALE[prec[c]] for c, a in parent.items() if a == v and isinstance(c, int))
            inputs += PRECISION_SCALE[p]
            out = PRECISION_SCALE[merge(lanes.get(v, {prec[v]}) | {p})]
            w = lan.workers[v]
            if (inputs + out) * r_est > _port(w) + 1e-9:
                return False
            summed = (inputs + PRECISION_SCALE[prec[v]]) * r_est
            return w.agg_gbit is None or summed <= w.agg_gbit + 1e-9
        return all(used.get(k, 0.0) + charge <= cap + 1e-9 for k, cap in pools(v, p))

    def take(v: Node, p: str, charge: float) -> None:
        for k, _ in pools(v, p):
            used[k] = used.get(k, 0.0) + charge

    for w in order:
        p = prec[w.index]
        if w.index in aggregating:  # it sums others: it sends to the gateway (two levels)
            parent[w.index] = GATEWAY
            continue
        ranked: list[tuple[float, int, int, Node]] = []
        for v in nodes:
            if v == w.index or (isinstance(v, int) and v in parent and parent[v] != GATEWAY):
                continue
            if capacity(lan, v, w.precision) <= 0:
                continue  # v cannot sum w's precision (the hardware's limit: the oblivious baseline too)
            d = 1 / path_rate(lan, w, v)
            if aware and inflation:
                d += _growth(lanes.get(v, _own(v, prec)), p) / _rate_up(lan, v)
            ranked.append((d, _hops(lan, w, v), 0, v))
        d_gw = 1 / path_rate(lan, w, GATEWAY)
        ranked.append((d_gw, _hops(lan, w, GATEWAY), 1, GATEWAY))  # ties: an aggregator (the PS is the fallback)
        ranked.sort(key=lambda t: (round(t[0], 12), t[1], t[2], str(t[3])))
        for *_, v in ranked:
            if v == GATEWAY:
                parent[w.index] = GATEWAY
                break
            charge = r_est * (PRECISION_SCALE[p] if aware else 1.0)
            fresh = isinstance(v, int) and v not in aggregating
            own = r_est * (PRECISION_SCALE[prec[v]] if aware else 1.0) if isinstance(v, int) and fresh else 0.0
            if fits(v, p, charge + own) and (not fresh or fits(v, prec[int(v)], charge + own)):
                if isinstance(v, int) and fresh:
                    aggregating.add(v)
                    take(v, prec[v], own)
                    lanes.setdefault(v, {prec[v]})
                take(v, p, charge)
                lanes.setdefault(v, set()).add(p)
                parent[w.index] = v
                break
    for v in nodes:
        if isinstance(v, str) and v in {*parent.values()}:
            parent[v] = GATEWAY
    return parent, notes


def _hops(lan: LanSpec, w: LanWorker, v: Node) -> int:
    """Switch hops from ``w`` to ``v`` (the tie-break the path cost may include): a rack's ToR is one,
    a ToR in another rack three, a worker in it four, the gateway or a worker alongside two."""
    if v == GATEWAY:
        return 2
    if isinstance(v, int):
        return 2 if lan.workers[v].rack == w.rack else 4
    return 1 if int(str(v)[4:]) == w.rack else 3


def _own(v: Node, prec: Mapping[int, str]) -> set[str]:
    return {prec[v]} if isinstance(v, int) else set()


def _growth(current: set[str], p: str) -> float:
    """Bytes (fp32 = 1) the aggregate grows by when a ``p`` gradient joins lanes ``current`` (0 for
    the first: an aggregate of one precision is no inflation)."""
    if not current:
        return 0.0
    return PRECISION_SCALE[merge(current | {p})] - PRECISION_SCALE[merge(current)]


def _rate_up(lan: LanSpec, v: Node) -> float:
    if isinstance(v, int):
        w = lan.workers[v]
        return min(_port(w), _uplink(lan, w.rack), lan.gateway_gbit)
    return min(lan.rack(int(str(v)[4:])).uplink_gbit, lan.gateway_gbit)


def _best(lan: LanSpec, name: str, **kw: bool) -> DcPlan:
    best: DcPlan | None = None
    for k in R_EST_LADDER:
        parent, notes = assign(lan, r_est_fraction=k, **kw)
        p = make_plan(name, lan, parent, notes, {"r_est_multiple": k, **({"inflation": kw["inflation"]}
                                                                        if kw["aware"] else {})})
        if best is None or p.prediction.gbit > best.prediction.gbit + 1e-9:
            best = p
    assert best is not None
    return best


def plan(lan: LanSpec, *, inflation: bool = True, tor: bool = True) -> DcPlan:
    return _best(lan, "pahina", aware=True, inflation=inflation, tor=tor)


def oblivious(lan: LanSpec, *, tor: bool = True) -> DcPlan:
    """The precision-oblivious baseline: Algorithm 1 as if every worker sent fp32."""
    return _best(lan, "precision-oblivious", aware=False, inflation=False, tor=tor)
