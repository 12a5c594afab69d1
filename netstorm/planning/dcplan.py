"""Plan a DC's LAN tier with one of the planners (``dc_planner``), and the baselines beside it.

``plan_dc`` runs a planner of the ``netstorm.dcplanners`` registry (``flat``, ``aleph``, ``pahina``,
``eina``) on a ``LanSpec`` and never returns a tree predicted slower than the flat gateway: it falls
back to it and says why (``no_worse_than_flat``). ``baselines`` gives the trees the papers compare
against (the flat gateway, ATP-style rack aggregation, GRID-style single aggregation, PAHInA's
precision-oblivious assignment) and the ring all-reduce, all judged by the one fluid model of
``lanmodel``.

``tor``: where the DC describes racks, EINA and ATP aggregate at the racks' ToR aggregators (their
papers' edge aggregators) and PAHInA uses them as its programmable nodes. The data plane runs only
worker aggregators two levels deep, so the scheduler plans with ``tor=False``: workers are then the
aggregators and racks only constrain, through their uplinks. A planner that needs racks says so in its
plan's notes when the DC has none. The tree baselines have the same two forms (``baseline_plan``):
without ToRs, ATP stands one worker per rack, drawn at random, in for the rack's ToR, and GRID's
aggregation points are workers; that form is what ``bench edge --dc-planner atp|grid`` deploys.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from netstorm import registry
from netstorm.dcplanners import DC_PLANNERS
from netstorm.errors import NetStormError, PolicyError
from netstorm.lan_scenario import LanSpec
from netstorm.planning import aleph, eina, pahina
from netstorm.planning.lanmodel import (
    GATEWAY,
    DcPlan,
    Node,
    Prediction,
    flat,
    make_plan,
    predict,
    ring_allreduce,
    tor_id,
)

if TYPE_CHECKING:
    from netstorm.config import Config

BASELINES = ("flat", "ring", "atp", "grid", "precision-oblivious")
TREE_BASELINES = ("atp", "grid", "precision-oblivious")
"""The baselines that are aggregation trees (the ring is not), so a DC can deploy them."""


@dataclass(frozen=True)
class Options:
    """The planners' knobs (``Config``'s DC-planning section)."""

    time_limit: float = 60.0
    """Seconds EINA's MILP may take before the heuristic answers."""
    integer_rates: bool = False
    """EINA's IQCP variant: integer rates (Gbit/s)."""
    depth: int = 3
    """EINA's d*: aggregators a flow may traverse, the gateway's included (3: two levels)."""
    inflation: bool = True
    """PAHInA: count the bytes a mixed-precision aggregate grows by when ranking candidates."""
    tor: bool = True
    """Aggregate at the racks' ToR aggregators where the DC describes racks."""
    rack_uplinks: bool = True
    """EINA and GRID see each rack's uplink as a link its aggregators share (a deviation: EINA's fabric is
    non-blocking, so without it a plan with workers as aggregators is blind to the uplinks it crosses)."""
    seed: int = 0
    fallback: bool = True
    """Return the flat gateway where the planner's tree is predicted slower (off: the planner's own tree,
    for measuring the planners themselves)."""

    @classmethod
    def from_config(cls, config: Config, **changes: Any) -> Options:
        base = cls(time_limit=config.dc_plan_time_limit, integer_rates=config.eina_integer_rates,
                   depth=config.eina_depth, inflation=config.pahina_inflation,
                   rack_uplinks=config.eina_rack_uplinks)
        return dataclasses.replace(base, **changes)


FALLBACK_TOLERANCE = 1e-9
"""Relative shortfall below the flat gateway's prediction that counts as worse (float noise is not)."""


def plan_dc(lan: LanSpec, planner: str, options: Options = Options()) -> DcPlan:
    """The tree, rates and prediction ``planner`` (a name of ``DC_PLANNERS``) gives this LAN; never a
    tree predicted slower than the flat gateway (``no_worse_than_flat``) unless ``options.fallback`` is off."""
    try:
        entry = DC_PLANNERS.get_entry(planner)
    except NetStormError as exc:
        raise PolicyError(str(exc)) from None
    plan: DcPlan = registry.load(entry.target)(lan, options)
    return no_worse_than_flat(lan, plan) if options.fallback else plan


def no_worse_than_flat(lan: LanSpec, plan: DcPlan) -> DcPlan:
    """``plan``, or the flat gateway's tree where ``plan`` is predicted slower, in the same model. The
    result keeps the planner's name and says which tree it fell back to and why (``fallback``, a note,
    ``detail["fallback"]``), so a DC never runs a plan predicted worse than doing nothing."""
    base = make_plan("flat", lan, flat(lan))
    planned, floor = plan.prediction.gbit, base.prediction.gbit
    if planned >= floor * (1 - FALLBACK_TOLERANCE):
        return plan
    why = (f"{plan.planner}'s tree was predicted {planned:.6g} Gbit/s (bottleneck {plan.prediction.bottleneck}), "
           f"below the flat gateway's {floor:.6g}: fell back to the flat gateway")
    detail = {**plan.detail, "fallback": {"to": "flat", "planned_gbit": round(planned, 6),
                                          "planned_bottleneck": plan.prediction.bottleneck,
                                          "flat_gbit": round(floor, 6)}}
    return dataclasses.replace(base, planner=plan.planner, notes=(*plan.notes, why), detail=detail,
                               fallback="flat")


def flat_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    """Today's tier (``dc_planner = "flat"``): every worker sends to the gateway."""
    return make_plan("flat", lan, flat(lan))


def aleph_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    return aleph.plan(lan, seed=options.seed)


def pahina_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    return pahina.plan(lan, inflation=options.inflation, tor=options.tor)


@dataclass(frozen=True)
class _Mapping:
    instance: eina.Instance
    node: dict[int, Node]
    """EINA aggregator -> the LAN node it stands for (a worker, a ToR, the gateway)."""
    members: dict[int, list[int]]
    """EINA aggregator -> workers pinned to it (a ToR's rack; a worker itself)."""


def eina_instance(lan: LanSpec, options: Options = Options()) -> _Mapping:
    """The LAN as EINA's instance: one PS (the gateway); aggregators are the racks' ToR aggregators
    (``tor``) and the workers no ToR takes (each pinned to itself); each rack's uplink is a link its
    aggregators share (``rack_uplinks``). A worker aggregator's c is
    min(port, agg_gbit): its port carries its own flow and its children's, pushes and results alike, so
    the same (children + a_j)·r bound holds. A ToR's uplink carries pushes and results both ways
    (``duplex``); every worker sends at r, so r^U is the slowest port under a ToR."""
    tors = list(lan.racks) if options.tor else []
    b_out: dict[int, float] = {}
    node: dict[int, Node] = {}
    members: dict[int, list[int]] = {}
    a: dict[int, int] = {}
    c: dict[int, float] = {}
    b: dict[int, float] = {}
    duplex: set[int] = set()
    k = 0
    r_high = max(min(w.up_gbit, w.down_gbit) for w in lan.workers)
    for rack in tors:
        inside = [w for w in lan.workers if w.rack == rack.id and rack.capacity(w.precision) > 0]
        if not inside:
            continue
        node[k], members[k], a[k] = tor_id(rack.id), [w.index for w in inside], len(inside)
        c[k], b[k] = rack.aggregator_gbit, rack.uplink_gbit
        if any(cap <= 0 for _, cap in rack.precision_gbit):
            b_out[k] = 0.0  # it cannot sum every lane: no other aggregator's flow may enter it
        else:
            duplex.add(k)
        r_high = min(r_high, *(min(w.up_gbit, w.down_gbit) for w in inside))
        k += 1
    taken = {w for m in members.values() for w in m}
    for w in lan.workers:
        if w.index in taken:
            continue
        port = min(w.up_gbit, w.down_gbit)
        node[k], members[k], a[k] = w.index, [w.index], 1
        c[k] = port if w.agg_gbit is None else min(port, w.agg_gbit)
        b[k] = port
        k += 1
    gw = k
    node[gw], members[gw], a[gw] = GATEWAY, [], 0
    c[gw] = b[gw] = lan.gateway_gbit
    shared = []
    for rack in lan.racks if options.rack_uplinks else ():
        behind = frozenset(j for j, n in node.items()
                           if n == tor_id(rack.id) or (isinstance(n, int) and lan.workers[n].rack == rack.id))
        if behind:
            shared.append((behind, rack.uplink_gbit))
    inst = eina.Instance(tuple(node), a, {0: gw}, c, b, {**b, **b_out}, r_high=r_high, depth=options.depth,
                         duplex=frozenset(duplex), shared=tuple(shared))
    return _Mapping(inst, node, members)


def _tree_to_parent(m: _Mapping, tree: Mapping[int, int]) -> dict[Node, Node]:
    parent: dict[Node, Node] = {}
    for agg, workers in m.members.items():
        here = m.node[agg]
        for w in workers:
            if w != here:
                parent[w] = here
        if agg in tree:
            parent[here] = m.node[tree[agg]]
    return parent


def eina_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    m = eina_instance(lan, options)
    sol = eina.solve(m.instance, integer=options.integer_rates, time_limit=options.time_limit)
    notes = []
    if not lan.racks and options.tor:
        notes.append("no racks: workers are EINA's edge aggregators, each hosting itself")
    if sol.method == "heuristic":
        notes.append(f"solver did not finish in {options.time_limit:g} s: {sol.status}")
    problems = eina.verify(m.instance, sol)
    if problems:
        raise PolicyError(f"EINA plan infeasible: {'; '.join(problems)}")
    parent = _tree_to_parent(m, sol.trees.get(0, {}))
    return make_plan("eina", lan, parent, notes, {
        "method": sol.method, "status": sol.status, "solve_s": round(sol.seconds, 6),
        "model_rate_gbit": {str(p): round(r, 6) for p, r in sol.rates.items()},
        "shares": {str(p): round(s, 9) for p, s in sol.shares().items()},
        "trees": {str(p): {str(m.node[ch]): m.node[pa] for ch, pa in t.items()} for p, t in sol.trees.items()},
        "integer_rates": options.integer_rates, "depth": options.depth})


def atp_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    """ATP-style: each worker to its rack's aggregator, the aggregate to the gateway.

    With ``tor`` the rack's ToR aggregator sums (ATP's programmable switch). Without (what the data
    plane runs: worker aggregators only) ATP's two-level form stands one worker of each rack in for
    its ToR, drawn at random from the seed: ATP's aggregation point is where the rack is, whatever
    the workers' bandwidth (EINA's evaluation of ATP: "random allocation and early aggregation"). A DC
    without racks is one rack whose ToR is the gateway: the flat gateway."""
    if not lan.racks:
        return make_plan("atp", lan, flat(lan), ["no racks: ATP-style aggregation is the flat gateway"])
    parent: dict[Node, Node] = {}
    if not options.tor:
        rng = random.Random(options.seed)
        for r in lan.racks:
            inside = sorted(w.index for w in lan.workers if w.rack == r.id)
            if not inside:
                continue
            stand_in = rng.choice(inside)
            for index in inside:
                parent[index] = GATEWAY if index == stand_in else stand_in
        for worker in lan.workers:
            parent.setdefault(worker.index, GATEWAY)
        return make_plan("atp", lan, parent, ["no ToR aggregators: one worker per rack, drawn at random, "
                                              "aggregates the rack"], {"seed": options.seed})
    for w in lan.workers:  # a ToR that cannot sum its precision passes it on to the gateway
        ok = w.rack is not None and lan.rack(w.rack).capacity(w.precision) > 0
        parent[w.index] = tor_id(w.rack) if ok and w.rack is not None else GATEWAY
    for r in lan.racks:
        parent[tor_id(r.id)] = GATEWAY
    return make_plan("atp", lan, parent)


def grid_plan(lan: LanSpec, options: Options = Options()) -> DcPlan:
    """GRID-style: single aggregation anywhere or none, from GRID's relaxation and randomized rounding."""
    m = eina_instance(lan, options)
    sol = eina.grid(m.instance, seed=options.seed)
    gw = m.instance.roots[0]
    parent: dict[Node, Node] = {}
    aggregating: set[int] = set()
    for group, point in sol.trees[0].items():
        target: Node = GATEWAY if point in (-1, gw) else m.node[point]
        for w in m.members[group]:
            if w != target:
                parent[w] = target
        if point not in (-1, gw):
            aggregating.add(point)
    for j in aggregating:
        parent[m.node[j]] = GATEWAY
    for worker in lan.workers:
        parent.setdefault(worker.index, GATEWAY)
    return make_plan("grid", lan, parent, [], {"seed": options.seed})


def baselines(lan: LanSpec, options: Options = Options()) -> dict[str, Prediction]:
    """Every baseline's prediction on this LAN."""
    return {"flat": predict(lan, flat(lan)), "ring": ring_allreduce(lan),
            **{name: baseline_plan(lan, name, options).prediction for name in TREE_BASELINES}}


def baseline_plan(lan: LanSpec, name: str, options: Options = Options()) -> DcPlan:
    """The tree of baseline ``name`` (one of ``TREE_BASELINES``); with ``tor=False`` it is the two-level
    form the data plane runs, which is how the emulation deploys a baseline."""
    if name == "atp":
        return atp_plan(lan, options)
    if name == "grid":
        return grid_plan(lan, options)
    if name == "precision-oblivious":
        return pahina.oblivious(lan, tor=options.tor)
    raise PolicyError(f"unknown baseline {name!r} (one of {', '.join(TREE_BASELINES)})")
