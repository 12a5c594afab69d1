"""Planners of the tier inside a DC: the fluid model, ALEPH, PAHInA, EINA and the baselines, against
hand-worked cases, brute force on small instances and the capacities they must never exceed."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import subprocess
import sys

import highspy
import pytest

from netstorm import scenario
from netstorm.config import Config
from netstorm.dcplanners import PLANNERS
from netstorm.errors import PolicyError
from netstorm.lan_scenario import LanSpec, LanWorker, Rack
from netstorm.planning import aleph, dcplan, eina, lanmodel, lanwire, pahina
from netstorm.planning.lanmodel import GATEWAY, PRECISION_SCALE, Node, predict, tor_id


def lan_of(ports: list[float], gateway: float, precisions: list[str] | None = None,
           racks: tuple[Rack, ...] = (), rack_of: list[int | None] | None = None,
           agg: list[float | None] | None = None) -> LanSpec:
    n = len(ports)
    return LanSpec(tuple(LanWorker(i, ports[i], ports[i], 0.0, (precisions or ["fp32"] * n)[i],
                                   (rack_of or [None] * n)[i], (agg or [None] * n)[i]) for i in range(n)),
                   racks, gateway)


def random_lan(rng: random.Random, n: int, *, racks: bool = False, mixed: bool = False) -> LanSpec:
    ports = [round(rng.uniform(1, 10), 3) for _ in range(n)]
    precisions = [rng.choice(["fp32", "fp16", "bf16", "int8"]) if mixed else "fp32" for _ in range(n)]
    if racks:
        rs = tuple(Rack(k, rng.uniform(5, 30), rng.uniform(2, 20),
                        (("int8", 0.0),) if k == 2 else ()) for k in (1, 2))
        return lan_of(ports, rng.uniform(3, 20), precisions, rs, [1 + i % 2 for i in range(n)])
    return lan_of(ports, rng.uniform(3, 20), precisions)


def loads_respected(lan: LanSpec, plan: lanmodel.DcPlan) -> None:
    """Independent check: at the plan's rates every port, uplink, gateway and aggregation capacity
    carries at most its rate (each edge carries its subtree's aggregate at the merged lane)."""
    parent = plan.parent
    rate = plan.rates
    t = PRECISION_SCALE[lan.workers[0].precision] / rate[0]
    below: dict[Node, set[str]] = {}
    for w in lan.workers:
        node: Node = w.index
        while node != GATEWAY:
            below.setdefault(node, set()).add(w.precision)
            node = parent[node]
    flow = {n: PRECISION_SCALE[lanmodel.merge(p)] / t for n, p in below.items()}  # Gbit/s on its edge up
    eps = 1e-6
    into: dict[Node, float] = {}
    for c, p in parent.items():
        into[p] = into.get(p, 0.0) + flow[c]
    for w in lan.workers:
        assert flow[w.index] + into.get(w.index, 0.0) <= min(w.up_gbit, w.down_gbit) + eps
        if w.agg_gbit is not None and w.index in into:
            assert into[w.index] + PRECISION_SCALE[w.precision] / t <= w.agg_gbit + eps
    assert into.get(GATEWAY, 0.0) <= lan.gateway_gbit + eps
    for r in lan.racks:
        tor = tor_id(r.id)
        per: dict[str, float] = {}
        for c, p in parent.items():
            if p == tor:
                lane = lanmodel.merge(below[c])
                per[lane] = per.get(lane, 0.0) + flow[c]
        for lane, gbit in per.items():
            assert gbit <= r.capacity(lane) + eps, (tor, lane)
        if not r.precision_gbit:
            assert sum(per.values()) <= r.aggregator_gbit + eps

        def inside(x: Node, rid: int = r.id) -> bool:
            return x != GATEWAY and (lan.workers[x].rack == rid if isinstance(x, int) else x == tor_id(rid))

        crossing = sum(flow[c] for c, p in parent.items() if inside(c) != inside(p))
        assert crossing <= r.uplink_gbit + eps


# --- the fluid model -------------------------------------------------------------------------------


def test_aleph_table_1_is_reproduced_by_the_model() -> None:
    """4 workers push 4.2 Gb each: PS 0.84 s, ring all-reduce 0.63 s, ALEPH 0.42 s (ALEPH Table 1)."""
    lan = lan_of([20, 10, 20, 10], 20)
    gb = 4.2
    assert predict(lan, lanmodel.flat(lan)).seconds_per_gbit * gb == pytest.approx(0.84)
    ring = lanmodel.ring_allreduce(lan)
    assert 2 * 3 / 4 * gb / 10 == pytest.approx(0.63)  # the paper's ring, 4 members
    assert ring.seconds_per_gbit * gb == pytest.approx(2 * 4 / 5 * gb / 10)  # with the gateway as a fifth
    aleph_tree: dict[Node, Node] = {0: GATEWAY, 1: 0, 2: GATEWAY, 3: 2}
    assert predict(lan, aleph_tree).seconds_per_gbit * gb == pytest.approx(0.42)


def test_flat_is_the_gateway_or_the_slowest_port() -> None:
    assert predict(lan_of([10] * 8, 40), lanmodel.flat(lan_of([10] * 8, 40))).gbit == pytest.approx(40)
    slow = lan_of([10, 10, 1], 40)
    p = predict(slow, lanmodel.flat(slow))
    assert p.gbit == pytest.approx(3.0) and p.bottleneck == "worker 2 port"


def test_lanes_merge_as_normalisation_requires() -> None:
    assert lanmodel.merge(["fp16", "fp16"]) == "fp16"
    assert lanmodel.merge(["fp16", "bf16"]) == "fp32"
    assert lanmodel.merge(["int8", "fp16"]) == "fp16"
    assert lanmodel.merge(["int8", "bf16", "int8"]) == "bf16"
    assert lanmodel.merge(["int8", "fp32"]) == "fp32"


def test_two_level_conversion_round_trips_and_refuses_what_the_data_plane_cannot_run() -> None:
    lan = lan_of([10] * 5, 10)
    tree: dict[Node, Node] = {0: GATEWAY, 1: 0, 2: 0, 3: GATEWAY, 4: 3}
    plan = lanmodel.make_plan("x", lan, tree)
    clusters, direct = lanmodel.two_level(plan)
    assert clusters == {0: [1, 2], 3: [4]} and direct == [0, 3]
    assert lanmodel.from_two_level(clusters, range(5)) == tree
    assert plan.runtime() == {"aggregators": [0, 3], "assignment": {0: None, 1: 0, 2: 0, 3: None, 4: 3},
                              "rates": plan.rates}
    deep = lanmodel.make_plan("x", lan, {0: GATEWAY, 1: 0, 2: 1, 3: GATEWAY, 4: GATEWAY})
    with pytest.raises(PolicyError, match="deeper"):
        lanmodel.two_level(deep)
    racked = lan_of([10] * 2, 10, racks=(Rack(1, 10, 10),), rack_of=[1, 1])
    with pytest.raises(PolicyError, match="ToR"):
        lanmodel.two_level(lanmodel.make_plan("x", racked, {0: "rack1", 1: "rack1", "rack1": GATEWAY}))


def test_broken_trees_are_refused() -> None:
    lan = lan_of([10] * 3, 10)
    with pytest.raises(PolicyError, match="not in the plan"):
        predict(lan, {0: GATEWAY, 1: GATEWAY})
    with pytest.raises(PolicyError, match="does not reach"):
        predict(lan, {0: 1, 1: 0, 2: GATEWAY})
    with pytest.raises(PolicyError, match="not a worker"):
        predict(lan, {0: GATEWAY, 1: GATEWAY, 2: 7})


# --- ALEPH -----------------------------------------------------------------------------------------


TESTBED = lan_of([30, 20, 20, 10, 10, 10, 10, 10], 40)
"""ALEPH's testbed: one 30, two 20 and five 10 Gbit/s workers."""


def test_aleph_capacities_match_the_testbed_example() -> None:
    assert aleph.capacities(TESTBED) == {0: 2, 1: 1, 2: 1, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0}
    assert aleph.capacities(lan_of([30, 10], 40, agg=[15.0, None]))[0] == 1  # C_w / c binds


def test_aleph_finds_the_testbed_clustering() -> None:
    """Two 20 Gbit/s aggregators with one member, the 30 Gbit/s one with two, one worker direct."""
    plan = aleph.plan(TESTBED)
    clusters, direct = lanmodel.two_level(plan)
    assert sorted(len(m) for m in clusters.values()) == [1, 1, 2] and len(direct) == 4
    assert plan.detail["clusters"] == aleph.optimum(aleph.capacities(TESTBED), aleph.neighbours(TESTBED)) == 4
    loads_respected(TESTBED, plan)


def test_aleph_never_exceeds_a_capacity_whatever_the_draws() -> None:
    rng = random.Random(3)
    for trial in range(60):
        lan = random_lan(rng, rng.randint(3, 12), racks=trial % 3 == 0)
        g, nbr = aleph.capacities(lan), aleph.neighbours(lan)
        c = aleph.mwcha(g, nbr, random.Random(trial))
        placed = [a for a in c.clusters] + [m for ms in c.clusters.values() for m in ms] + list(c.direct)
        assert sorted(placed) == sorted(g)  # every worker in exactly one cluster (Theorem 3)
        for agg, members in c.clusters.items():
            assert 1 <= len(members) <= g[agg]
            assert all(m in nbr[agg] for m in members)


def test_aleph_never_beats_the_brute_force_optimum_on_small_dcs() -> None:
    """Enumeration's optimum is a lower bound on every M-WCHA run (a run below it would be a clustering
    that breaks a capacity or covers a worker twice)."""
    rng = random.Random(11)
    for trial in range(40):
        lan = random_lan(rng, rng.randint(3, 8), racks=trial % 4 == 0)
        g, nbr = aleph.capacities(lan), aleph.neighbours(lan)
        opt = aleph.optimum(g, nbr)
        assert 1 <= opt <= min(aleph.mwcha(g, nbr, random.Random(s)).size for s in range(8))


def hub_lan(rng: random.Random, racks: int, size: int, hubs: int) -> LanSpec:
    """``racks`` racks (none when 1) of ``size`` workers: ``hubs`` per rack with ports of size/hubs,
    the rest 1-2.5 Gbit/s (one at exactly 1, the b of g_w). Each hub then takes size/hubs - 1 members:
    the optimum is racks x hubs clusters."""
    ports = []
    for _ in range(racks):
        ports += [size / hubs] * hubs + [round(rng.uniform(1, 2.5), 3) for _ in range(size - hubs)]
    ports[hubs] = 1.0
    rs = tuple(Rack(k + 1, 100, 100) for k in range(racks)) if racks > 1 else ()
    return lan_of(ports, 1000.0, racks=rs, rack_of=[1 + i // size for i in range(len(ports))] if rs else None)


@pytest.mark.parametrize(("racks", "size", "hubs"), [(1, 120, 2), (2, 45, 1)])
def test_aleph_approximation_claim_holds_against_brute_force(racks: int, size: int, hubs: int) -> None:
    """Theorem 7 as the notes state it: E|D| <= 8·H_Δ·|OPT|, Δ = max(g_w, one-hop degree) + 1, the mean
    of seeded runs standing for the expectation. The factor is loose (8·H_Δ >= 12), so only DCs with
    more workers than 8·H_Δ·|OPT| can break it: sending every worker alone would."""
    for seed in range(3):
        lan = hub_lan(random.Random(seed), racks, size, hubs)
        g, nbr = aleph.capacities(lan), aleph.neighbours(lan)
        opt = aleph.optimum(g, nbr)
        assert opt == racks * hubs
        bound = aleph.harmonic_bound(g, nbr) * opt
        assert len(lan.workers) > bound  # the claim has teeth here
        sizes = [aleph.mwcha(g, nbr, random.Random(s)).size for s in range(8)]
        assert min(sizes) >= opt
        assert sum(sizes) / len(sizes) <= bound


def test_aleph_optimum_by_enumeration_matches_the_greedy_count_on_a_complete_graph() -> None:
    """With every worker adjacent, the optimum is the fewest largest (1 + g) that cover n."""
    rng = random.Random(5)
    for _ in range(20):
        lan = random_lan(rng, rng.randint(2, 8))
        g, nbr = aleph.capacities(lan), aleph.neighbours(lan)
        sizes = sorted((1 + v for v in g.values()), reverse=True)
        k = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) >= len(sizes))
        assert aleph.optimum(g, nbr) == k


# --- PAHInA ----------------------------------------------------------------------------------------


def test_pahina_groups_precisions_where_the_oblivious_assignment_inflates() -> None:
    """fp16 and bf16 alternate behind a congested gateway: pairing across them up-casts to fp32."""
    lan = lan_of([10] * 8, 10, ["fp16", "bf16"] * 4)
    aware, blind = pahina.plan(lan), pahina.oblivious(lan)
    for plan in (aware, blind):
        loads_respected(lan, plan)
    for agg, members in lanmodel.two_level(aware)[0].items():
        assert {lan.workers[m].precision for m in members} == {lan.workers[agg].precision}
    # hand-worked: two homogeneous clusters of four, each aggregator's port carries 4 fp16-sized flows
    # (0.5 + 3 x 0.5 per Gbit at 10 Gbit/s: T = 0.2 s per Gbit, 8 x 0.5 / 0.2 = 20 Gbit/s)
    assert aware.prediction.gbit == pytest.approx(20.0)
    assert blind.prediction.gbit < aware.prediction.gbit  # its mixed pairs travel as fp32
    literal = pahina.plan(lan, inflation=False)
    assert literal.prediction.gbit <= aware.prediction.gbit + 1e-9


def test_pahina_fills_aggregator_ports_by_bytes_where_the_oblivious_assignment_counts_members() -> None:
    """lan-precision's DC 1 (the paper's 5:3:2 mix): the fp32 workers' 20 Gbit/s ports are the capacity,
    and an int8 member takes a quarter of what an fp32 one would."""
    lan = scenario.load("lan-precision").node(1).lan
    assert lan is not None
    aware, blind = pahina.plan(lan, tor=False), pahina.oblivious(lan, tor=False)
    for plan in (aware, blind):
        loads_respected(lan, plan)
        # aggregators are fp32 workers: their aggregates travel in 32-bit lanes in the model as on the
        # wire (the data plane forwards int32 partial sums whatever the members' precision)
        assert all(lan.workers[a].precision == "fp32" for a in lanmodel.two_level(plan)[0])
    aware_clusters = lanmodel.two_level(aware)[0]
    assert sorted(len(m) for m in aware_clusters.values()) == [3, 4]
    assert all(len(m) == 3 for m in lanmodel.two_level(blind)[0].values())
    pushed = 2 * 1.0 + 3 * 0.5 + 5 * 0.25
    # hand-worked: aware, the busier aggregator's port carries its aggregate and one fp16 and three int8
    # pushes (1 + 0.5 + 0.75 per Gbit at 20 Gbit/s); oblivious, three members per aggregator leave two
    # fp16 workers direct, and two fp32 aggregates and two fp16 pushes reach the 20 Gbit/s gateway
    # (1 + 1 + 0.5 + 0.5)
    assert aware.prediction.gbit == pytest.approx(pushed / (2.25 / 20))
    assert blind.prediction.gbit == pytest.approx(pushed / (3.0 / 20))
    assert aware.prediction.gbit >= 1.3 * blind.prediction.gbit
    for plan in (aware, blind):  # the gain is one the data plane can show
        assert lanwire.wire_cost(lan, plan).gbit == pytest.approx(plan.prediction.gbit)
    # DC 2: one fp32 node per eight narrow workers; by bytes its port takes all eight, by count four
    lan = scenario.load("lan-precision").node(2).lan
    assert lan is not None
    aware, blind = pahina.plan(lan, tor=False), pahina.oblivious(lan, tor=False)
    assert lanmodel.two_level(aware)[0] == {0: list(range(1, 9))}
    assert aware.prediction.gbit == pytest.approx(2 * blind.prediction.gbit)
    for plan in (aware, blind):
        assert lanwire.wire_cost(lan, plan).gbit == pytest.approx(plan.prediction.gbit)


def test_wire_cost_counts_aggregates_and_results_in_32_bit_lanes() -> None:
    """An int8 cluster: the model's aggregate is int8-sized, the wire's int32; an fp32 aggregator's
    cluster, on downlinks wide enough for 32-bit results, costs the same in both."""
    narrow = lan_of([10] * 4, 10, ["int8"] * 4)
    plan = lanmodel.make_plan("test", narrow, {0: GATEWAY, 1: 0, 2: 0, 3: 0})
    # model: the aggregator's port carries 0.25 + 3 x 0.25 per Gbit at 10 Gbit/s
    assert plan.prediction.seconds_per_gbit == pytest.approx(0.1)
    wire = lanwire.wire_cost(narrow, plan)
    # wire: its downlink carries the 32-bit result and three int8 pushes, 1.75 per Gbit at 10 Gbit/s
    assert wire.seconds_per_gbit == pytest.approx(0.175)
    assert wire.bottleneck == "worker 0 downlink"
    mixed = LanSpec((LanWorker(0, 20, 20, 0.0, "fp32"), LanWorker(1, 10, 20, 0.0, "fp16"),
                     LanWorker(2, 8, 32, 0.0, "int8")), (), 20)
    plan = lanmodel.make_plan("test", mixed, {0: GATEWAY, 1: 0, 2: 0})
    assert lanwire.wire_cost(mixed, plan).seconds_per_gbit == pytest.approx(plan.prediction.seconds_per_gbit)
    assert plan.prediction.seconds_per_gbit == pytest.approx((1 + 0.5 + 0.25) / 20)


def test_pahina_respects_per_precision_capacity_and_the_precision_filter() -> None:
    racks = (Rack(1, 100, 100, (("int8", 0.0), ("fp16", 3.0))), Rack(2, 100, 100))
    lan = lan_of([10] * 8, 8, ["int8", "fp16", "fp32", "fp16"] * 2, racks, [1, 1, 1, 1, 2, 2, 2, 2])
    plan = pahina.plan(lan)
    for w in lan.workers:
        if w.rack == 1 and w.precision == "int8":
            assert plan.parent[w.index] != tor_id(1)
    loads_respected(lan, plan)


def test_pahina_closed_form_equals_the_stage_2_lp() -> None:
    """Stage 2 as the LP: max m with y_{s,p} >= w_p·m for every input, y <= C_{s,p} and every link's
    load within its rate; its optimum is the closed form the model computes."""
    rng = random.Random(2)
    for _ in range(15):
        lan = random_lan(rng, rng.randint(3, 9), racks=True, mixed=True)
        plan = pahina.plan(lan)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.addCol(1.0, 0.0, highspy.kHighsInf, 0, [], [])  # m
        lanes = lanmodel.subtree_lanes(lan, plan.parent)
        parent = plan.parent
        y: dict[Node, int] = {}
        for node in {p for p in parent.values() if p != GATEWAY}:
            h.addCol(0.0, 0.0, highspy.kHighsInf, 0, [], [])
            y[node] = h.getNumCol() - 1
        size = {n: PRECISION_SCALE[lanes[n]] for n in lanes}
        for p in parent.values():  # synchronization: the output stream carries every input's lane
            if p in y:
                h.addRow(0.0, highspy.kHighsInf, 2, [y[p], 0], [1.0, -size[p]])
        for node, col in y.items():
            # links: the node's port (or uplink) carries its output and its inputs at w_p·m
            if isinstance(node, int):
                w = lan.workers[node]
                kids = sum(size[c] for c, p in parent.items() if p == node)
                h.addRow(-highspy.kHighsInf, min(w.up_gbit, w.down_gbit), 2, [col, 0], [1.0, kids])
        for w in lan.workers:
            if w.index not in y:
                h.addRow(-highspy.kHighsInf, min(w.up_gbit, w.down_gbit), 1, [0], [size[w.index]])
        for r in lan.racks:
            tor = tor_id(r.id)
            per: dict[str, float] = {}
            for c, p in parent.items():
                if p == tor:
                    per[lanes[c]] = per.get(lanes[c], 0.0) + size[c]
            for lane, coef in per.items():
                h.addRow(-highspy.kHighsInf, r.capacity(lane), 1, [0], [coef])
            if per and not r.precision_gbit:
                h.addRow(-highspy.kHighsInf, r.aggregator_gbit, 1, [0], [sum(per.values())])

            def inside(x: Node, rid: int = r.id, spec: LanSpec = lan) -> bool:
                return x != GATEWAY and (spec.workers[x].rack == rid if isinstance(x, int) else x == tor_id(rid))

            crossing = sum(size[c] for c, p in parent.items() if inside(c) != inside(p))
            if crossing:
                h.addRow(-highspy.kHighsInf, r.uplink_gbit, 1, [0], [crossing])
        into_gw = sum(size[c] for c, p in parent.items() if p == GATEWAY)
        h.addRow(-highspy.kHighsInf, lan.gateway_gbit, 1, [0], [into_gw])
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        h.run()
        m = h.getSolution().col_value[0]
        assert m == pytest.approx(1 / plan.prediction.seconds_per_gbit, rel=1e-6)


# --- EINA ------------------------------------------------------------------------------------------


TOY = dict(aggregators=(0, 1, 2, 3, 4), workers={0: 0, 1: 2, 2: 2, 3: 1, 4: 0},
           c={i: 10.0 for i in range(5)}, b_in={i: 10.0 for i in range(5)},
           b_out={0: 1.0, 1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}, r_high=100.0, depth=4)


def test_eina_printed_model_sinks_flows_into_an_idle_aggregator_and_the_corrected_one_does_not() -> None:
    inst = eina.Instance(roots={0: 0}, **TOY)  # type: ignore[arg-type]
    literal = eina.solve_milp(inst, literal=True)
    assert literal.status == "optimal" and literal.total == pytest.approx(5.0)
    assert any("receives but does not forward" in p for p in eina.verify(inst, literal))
    fixed = eina.solve_milp(inst)
    assert fixed.total == pytest.approx(1.0, abs=1e-5) and not eina.verify(inst, fixed)
    assert eina.heuristic(inst).total == pytest.approx(1.0, abs=1e-6)


def test_eina_root_hosting_workers_is_infeasible_as_printed_and_feasible_corrected() -> None:
    inst = eina.Instance(roots={0: 1}, **TOY)  # type: ignore[arg-type]
    assert eina.solve_milp(inst, literal=True).status == "infeasible"
    fixed = eina.solve_milp(inst)
    assert fixed.status == "optimal" and fixed.total > 0 and not eina.verify(inst, fixed)
    assert 1 not in fixed.trees[0]


def test_eina_printed_10_counts_local_workers_once_per_other_aggregator() -> None:
    """Defect 1: one worker aggregator (2 workers, c = 10) under the PS: Σ (x + a_j)·r over the two
    other aggregators counts its 2 workers twice (r = 10 / 4), the intended form once (r = 10 / 2)."""
    inst = eina.Instance((0, 1, 2), {1: 2}, {0: 0}, {j: 10.0 for j in range(3)}, {j: 100.0 for j in range(3)},
                         {j: 100.0 for j in range(3)}, r_high=100.0)
    assert eina.solve_milp(inst, printed=frozenset({"10"})).total == pytest.approx(2.5)
    fixed = eina.solve_milp(inst)
    assert fixed.total == pytest.approx(5.0) == pytest.approx(_brute(inst)) and not eina.verify(inst, fixed)


def test_eina_printed_11_caps_by_unused_aggregators_and_exempts_forwarding_roots() -> None:
    """Defect 5, both halves. An idle aggregator no tree needs (b^I = 1) caps the printed Σ r_p at 1;
    the corrected model reaches c_1 / a_1 = 10. With two PSs, PS 1's aggregator (b^I = 1) may relay
    PS 0's flows as printed, since (11) exempts every PS's aggregator: the printed optimum (r = 10 + 20)
    sends 10 through a 1 Gbit/s uplink; corrected, PS 0's two worker aggregators go straight to its
    aggregator (c_0 = 10: r_0 = 5) and PS 1 runs at r^U = 20."""
    idle = eina.Instance((0, 1, 2), {1: 1}, {0: 0}, {j: 10.0 for j in range(3)}, {0: 10.0, 1: 10.0, 2: 1.0},
                         {j: 10.0 for j in range(3)}, r_high=100.0)
    assert eina.solve_milp(idle, printed=frozenset({"11"})).total == pytest.approx(1.0)
    assert eina.solve_milp(idle).total == pytest.approx(10.0) == pytest.approx(_brute(idle))
    relay = eina.Instance((0, 1, 2, 3), {2: 1, 3: 1}, {0: 0, 1: 1}, {0: 10.0, 1: 100.0, 2: 100.0, 3: 100.0},
                          {0: 100.0, 1: 1.0, 2: 100.0, 3: 100.0}, {0: 100.0, 1: 100.0, 2: 0.0, 3: 0.0},
                          r_high=20.0)
    printed = eina.solve_milp(relay, printed=frozenset({"11"}))
    assert printed.total == pytest.approx(30.0)
    assert any("aggregator 1: sends 10 > b^I 1" in p for p in eina.verify(relay, printed))
    fixed = eina.solve_milp(relay)
    assert fixed.rates == pytest.approx({0: 5.0, 1: 20.0}) and not eina.verify(relay, fixed)
    assert fixed.total == pytest.approx(_brute(relay))


NOTES_TWO_PS = eina.Instance(
    tuple(range(6)), {2: 5, 3: 6, 4: 7, 5: 8}, {0: 0, 1: 1},
    {0: 250.0, 1: 230.0, 2: 210.0, 3: 290.0, 4: 260.0, 5: 240.0},
    {0: 300.0, 1: 280.0, 2: 220.0, 3: 260.0, 4: 240.0, 5: 200.0},
    {0: 60.0, 1: 270.0, 2: 230.0, 3: 250.0, 4: 205.0, 5: 215.0}, r_high=300.0, depth=6)
"""The notes' 2-PS case (checks/eina_literal_model.py): Σ r_p = 30 both as {10, 20} and as {0, 30}."""


def test_eina_a_floor_keeps_every_ps_in_use_where_the_objective_alone_starves_one() -> None:
    """Defect 8 on the notes' case: the plan giving PS 0 nothing (the notes' IQCP answer) is feasible and
    optimal at r^L = 0, and the heuristic finds exactly that; with r^L = 5 it is refused, and the MILP
    (either rate kind) and the heuristic keep both PSs at 5 or more at the same Σ = 30 (= c_5 / a_5)."""
    inst = NOTES_TWO_PS
    assert inst.bound() == pytest.approx(30.0)
    assert eina.solve_milp(inst).total == pytest.approx(30.0)
    starved = eina.Solution({0: 0.0, 1: 30.0}, {0: {}, 1: {2: 1, 3: 1, 4: 3, 5: 1}}, "notes", "", 0.0)
    assert not eina.verify(inst, starved)
    quick = eina.heuristic(inst)
    assert quick.rates[0] == 0.0 and quick.total == pytest.approx(30.0) and not eina.verify(inst, quick)
    floor = dataclasses.replace(inst, r_low=5.0)
    assert any("r_0 = 0.0 outside" in p for p in eina.verify(floor, starved))
    for sol in (eina.solve_milp(floor), eina.solve_milp(floor, integer=True), eina.heuristic(floor)):
        assert min(sol.rates.values()) >= 5.0 - 1e-6 and sol.total == pytest.approx(30.0), sol.method
        assert not eina.verify(floor, sol) and all(sol.trees[p] for p in floor.roots)
    assert eina.heuristic(dataclasses.replace(inst, r_low=31.0)).total == 0.0  # no tree at the floor


def _trees(inst: eina.Instance, p: int) -> list[dict[int, int]]:
    """Every tree of PS p the corrected model allows: each worker aggregator (not the root) sends, each
    aggregator that receives forwards and an idle one forwards only what it receives, all reach the
    root within d̂."""
    root = inst.roots[p]
    others = [a for a in inst.aggregators if a != root]
    out = []
    for choice in itertools.product([None, *inst.aggregators], repeat=len(others)):
        tree = {a: c for a, c in zip(others, choice, strict=True) if c is not None}
        if any(a == c for a, c in tree.items()) or any(a not in tree for a in inst.with_workers if a != root):
            continue
        if any(c != root and c not in tree for c in tree.values()):
            continue
        if any(a not in tree.values() for a in tree if a not in inst.with_workers):
            continue
        ok = True
        for v in tree:  # every parent is the root or sends itself: follow it, a cycle runs out of hops
            u, hops = v, 0
            while u != root and hops <= inst.max_depth:
                u, hops = tree[u], hops + 1
            ok = ok and u == root and hops <= inst.max_depth
        if ok:
            out.append(tree)
    return out


def _brute(inst: eina.Instance) -> float:
    """Every combination of every PS's allowed trees; rates by the fixed-tree LP, checked by ``verify``."""
    best = 0.0
    for combo in itertools.product(*(_trees(inst, p) for p in inst.roots)):
        trees = dict(zip(inst.roots, combo, strict=True))
        rates = eina.best_rates(inst, trees)
        if not eina.verify(inst, eina.Solution(rates, trees, "brute", "", 0.0)):
            best = max(best, sum(rates.values()))
    return best


def test_eina_milp_matches_brute_force_and_the_heuristic_stays_feasible() -> None:
    rng = random.Random(4)
    for _ in range(12):
        n = rng.randint(3, 5)
        inst = eina.random_instance(rng, aggregators=n, pss=1, idle=rng.randint(0, 1), workers=(1, 3),
                                    capacity=(5, 40), depth=rng.choice([3, 4]))
        if rng.random() < 0.5:  # a rack's uplink shared by some aggregators
            inside = frozenset(rng.sample(inst.aggregators[1:], rng.randint(1, n - 1)))
            inst = dataclasses.replace(inst, shared=((inside, rng.uniform(5, 40)),))
        exact = eina.solve_milp(inst)
        assert exact.status == "optimal" and not eina.verify(inst, exact)
        assert exact.total == pytest.approx(_brute(inst), rel=1e-5, abs=1e-6)
        assert exact.total <= inst.bound() + 1e-6
        quick = eina.heuristic(inst)
        assert not eina.verify(inst, quick) and quick.total <= exact.total + 1e-6
        integer = eina.solve_milp(inst, integer=True)
        assert integer.total <= exact.total + 1e-6 and all(float(r).is_integer() for r in integer.rates.values())


@pytest.mark.parametrize("pss", [2, 3])
def test_eina_milp_matches_brute_force_with_several_pss(pss: int) -> None:
    """Several PSs share every capacity: the MILP's Σ r_p equals the best over every combination of
    every PS's trees, PS aggregators with workers included (defect 4 with more than one PS)."""
    rng = random.Random(20 + pss)
    for trial in range(4):
        inst = eina.random_instance(rng, aggregators=4, pss=pss, idle=0, workers=(1, 3), capacity=(5, 40),
                                    depth=rng.choice([3, 4]))
        if trial % 2:  # PSs on aggregators that host workers
            inst = dataclasses.replace(inst, roots={p: 3 - p for p in inst.roots})
        if trial >= 2:  # and a shared uplink
            inst = dataclasses.replace(inst, shared=((frozenset({2, 3}), rng.uniform(5, 40)),))
        exact = eina.solve_milp(inst)
        assert exact.status == "optimal" and not eina.verify(inst, exact)
        assert exact.total == pytest.approx(_brute(inst), rel=1e-5, abs=1e-6)
        quick = eina.heuristic(inst)
        assert not eina.verify(inst, quick) and quick.total <= exact.total + 1e-6


def test_eina_with_workers_as_aggregators_sees_the_racks_uplinks() -> None:
    """lan-hetero-4's DC 2, two racks of four behind 4 Gbit/s uplinks: with workers as the aggregators
    (what the runtime plans) and the uplinks unseen, EINA's best is flat, which the uplinks hold to 8
    Gbit/s; seeing them, it clusters inside the racks and sends fewer flows across them."""
    lan = scenario.load("lan-hetero-4").node(2).lan
    assert lan is not None
    blind = dcplan.plan_dc(lan, "eina", dcplan.Options(tor=False, rack_uplinks=False))
    seeing = dcplan.plan_dc(lan, "eina", dcplan.Options(tor=False))
    flat = dcplan.plan_dc(lan, "flat")
    assert blind.prediction.gbit == pytest.approx(flat.prediction.gbit) == pytest.approx(8.0)
    assert blind.prediction.bottleneck.endswith("uplink")
    assert seeing.prediction.gbit > 1.25 * flat.prediction.gbit
    assert seeing.detail["model_rate_gbit"]["0"] * len(lan.workers) == pytest.approx(seeing.prediction.gbit)
    loads_respected(lan, seeing)
    clusters, _ = lanmodel.two_level(seeing)
    assert clusters and all(lan.workers[m].rack == lan.workers[a].rack for a, ms in clusters.items() for m in ms)


def test_the_rack_uplinks_option_reaches_the_planner_from_the_config() -> None:
    """``eina_rack_uplinks = false`` in a config is the paper's non-blocking model: on lan-hetero-4's DC 2
    the scheduler's options then plan what flat plans, and the default sees the uplinks."""
    lan = scenario.load("lan-hetero-4").node(2).lan
    assert lan is not None
    paper = dcplan.plan_dc(lan, "eina", dcplan.Options.from_config(Config(eina_rack_uplinks=False), tor=False))
    ours = dcplan.plan_dc(lan, "eina", dcplan.Options.from_config(Config(), tor=False))
    assert paper.prediction.gbit == pytest.approx(dcplan.plan_dc(lan, "flat").prediction.gbit)
    assert ours.prediction.gbit > 1.25 * paper.prediction.gbit


def test_eina_falls_back_to_the_heuristic_when_the_budget_is_spent() -> None:
    """40 aggregators, 3 PSs: HiGHS cannot even presolve the model in its smallest budget (10 ms), so
    there is no incumbent and the heuristic's plan is what ``solve`` returns."""
    inst = eina.random_instance(random.Random(9), aggregators=40, pss=3, idle=4, workers=(1, 3),
                                capacity=(30, 300), depth=9)
    sol = eina.solve(inst, time_limit=0.0)
    assert sol.method == "heuristic" and sol.status.startswith("milp ") and sol.status.endswith("heuristic used")
    assert "time limit" in sol.status
    assert not eina.verify(inst, sol) and sol.total > 0
    quick = eina.heuristic(inst)
    assert sol.rates == quick.rates and sol.trees == quick.trees
    assert sum(sol.shares().values()) == pytest.approx(1.0)


def test_eina_baselines_are_feasible_plans() -> None:
    rng = random.Random(8)
    for _ in range(5):
        inst = eina.random_instance(rng, aggregators=6, pss=2, idle=1, workers=(2, 5), capacity=(20, 60))
        atp = eina.atp(inst)
        assert not eina.verify(inst, atp)
        grid = eina.grid(inst, seed=1)
        assert all(r >= 0 for r in grid.rates.values())
        assert eina.solve_milp(inst).total >= atp.total - 1e-6


# --- every planner on DCs ----------------------------------------------------------------------------


@pytest.mark.parametrize("planner", [pytest.param(p, marks=pytest.mark.slow) if p == "eina" else p
                                     for p in PLANNERS])
def test_every_planner_keeps_every_capacity_on_random_dcs(planner: str) -> None:
    rng = random.Random(hash(planner) % 1000)
    for trial in range(12):
        lan = random_lan(rng, rng.randint(2, 9), racks=trial % 2 == 0, mixed=trial % 3 == 0)
        for tor in (True, False):
            plan = dcplan.plan_dc(lan, planner, dcplan.Options(tor=tor, time_limit=10))
            loads_respected(lan, plan)
            if not tor:
                lanmodel.two_level(plan)  # what the scheduler pushes: always runnable
        for name in dcplan.TREE_BASELINES:
            for tor in (True, False):
                plan = dcplan.baseline_plan(lan, name, dcplan.Options(tor=tor, seed=trial))
                assert plan.planner == name
                loads_respected(lan, plan)
                if not tor:
                    lanmodel.two_level(plan)  # what bench edge --dc-planner deploys


@pytest.mark.parametrize("name", ["lan-hetero-4", pytest.param("lan-planning", marks=pytest.mark.slow),
                                  pytest.param("lan-precision", marks=pytest.mark.slow)])
def test_every_planner_runs_on_every_described_dc(name: str) -> None:
    s = scenario.load(name)
    for node in s.nodes:
        if node.lan is None:
            continue
        base = dcplan.baselines(node.lan)
        assert set(base) == set(dcplan.BASELINES)
        for planner in PLANNERS:
            plan = dcplan.plan_dc(node.lan, planner)
            assert plan.prediction.gbit > 0 and math.isfinite(plan.prediction.gbit)
            if not node.lan.racks and planner != "flat":
                assert plan.notes  # says how it degrades without racks


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "netstorm.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_cli_json_shape() -> None:
    out = _cli("lan-planning", "--dc", "2", "--dc-planner", "pahina", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["dc"] == 2 and r["planner"] == "pahina"
    assert set(r["assignment"]) == set(r["rates"]) == {str(i) for i in range(8)}
    assert all(v is None or isinstance(v, int | str) for v in r["assignment"].values())
    assert set(r["aggregators"]) == {v for v in r["assignment"].values() if v is not None}
    assert isinstance(r["predicted_gbit"], float) and set(r["baselines"]) == set(dcplan.BASELINES)
    assert r["baselines"]["flat"] > 0 and set(r["planners"]) == set(PLANNERS)
    assert r["predicted_gbit"] == r["planners"]["pahina"]
    assert "clusters" in r["runtime"]


def test_cli_refuses_a_dc_without_a_lan() -> None:
    out = _cli("lan-planning", "--dc", "4")
    assert out.returncode == 1 and "has no described LAN" in out.stderr
    out = _cli("lan-planning", "--dc", "9")
    assert out.returncode == 1 and "no DC 9" in out.stderr


def test_cli_text_names_the_chosen_planner_and_every_baseline() -> None:
    out = _cli("lan-hetero-4", "--dc", "3", "--dc-planner", "aleph")
    assert out.returncode == 0, out.stderr
    assert "planner aleph" in out.stdout and "flat (baseline)" in out.stdout and "ring (baseline)" in out.stdout
