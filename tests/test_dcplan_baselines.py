"""The papers' baselines as trees a DC can deploy: ATP's and GRID's two-level forms (workers as the only
aggregators, as the data plane runs them), and ``bench edge --dc-planner`` deploying them."""

from __future__ import annotations

import argparse
import random

import pytest

from netstorm import scenario
from netstorm.bench import edge
from netstorm.config import Config
from netstorm.errors import NetStormError, PolicyError
from netstorm.lan_scenario import LanSpec, LanWorker, Rack
from netstorm.planning import dcplan, lanmodel
from netstorm.planning.lanmodel import GATEWAY, tor_id


def racked(ports: list[float], rack_of: list[int], gateway: float = 100.0) -> LanSpec:
    racks = tuple(Rack(r, 100.0, 100.0) for r in sorted(set(rack_of)))
    return LanSpec(tuple(LanWorker(i, p, p, 0.0, "fp32", rack_of[i]) for i, p in enumerate(ports)), racks, gateway)


def test_atp_two_level_form_stands_one_worker_of_each_rack_in_for_its_tor() -> None:
    """Six workers in two racks of three, all at 10 Gbit/s: each rack's stand-in takes its two rack mates
    and sends one aggregate; its port carries three flows each way, so 10 / 3 Gbit/s per worker, 6 x that
    in all (hand-worked). With ToRs, the racks' aggregators sum instead."""
    lan = racked([10.0] * 6, [1, 1, 1, 2, 2, 2])
    for seed in range(4):
        plan = dcplan.atp_plan(lan, dcplan.Options(tor=False, seed=seed))
        clusters, direct = lanmodel.two_level(plan)
        assert len(clusters) == 2 and sorted(direct) == sorted(clusters)
        for agg, members in clusters.items():
            rack = lan.workers[agg].rack
            assert sorted([agg, *members]) == [w.index for w in lan.workers if w.rack == rack]
        assert plan.prediction.gbit == pytest.approx(6 * 10 / 3)
    with_tor = dcplan.atp_plan(lan, dcplan.Options(tor=True))
    assert all(with_tor.parent[w.index] == tor_id(w.rack) for w in lan.workers if w.rack is not None)
    assert with_tor.parent[tor_id(1)] == with_tor.parent[tor_id(2)] == GATEWAY


def test_atp_without_racks_is_the_flat_gateway() -> None:
    lan = LanSpec(tuple(LanWorker(i, 10.0, 10.0) for i in range(4)), (), 20.0)
    for tor in (True, False):
        plan = dcplan.atp_plan(lan, dcplan.Options(tor=tor))
        assert dict(plan.parent) == dict(lanmodel.flat(lan)) and plan.notes


def test_every_tree_baseline_has_a_runnable_two_level_form_on_random_dcs() -> None:
    rng = random.Random(6)
    for trial in range(10):
        n = rng.randint(3, 9)
        ports = [round(rng.uniform(1, 10), 3) for _ in range(n)]
        lan = racked(ports, [1 + i % rng.randint(1, 3) for i in range(n)], rng.uniform(3, 20))
        for name in dcplan.TREE_BASELINES:
            plan = dcplan.baseline_plan(lan, name, dcplan.Options(tor=False, seed=trial))
            assert plan.planner == name and plan.prediction.gbit > 0
            clusters, direct = lanmodel.two_level(plan)
            placed = [*direct, *(m for ms in clusters.values() for m in ms)]
            assert sorted(placed) == list(range(n))
    with pytest.raises(PolicyError, match="unknown baseline"):
        dcplan.baseline_plan(lan, "ring")


def _args(**given: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    edge.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in given.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(("name", "dc"), [("lan-hetero-4", 2), ("lan-runtime-3", 1)])
def test_bench_edge_deploys_the_baselines_two_level_forms(name: str, dc: int) -> None:
    """``--dc-planner atp|grid`` deploys exactly ``baseline_plan``'s two-level clusters and records the
    baseline's option value and prediction."""
    spec = scenario.load(name).node(dc).lan
    assert spec is not None
    for planner in ("atp", "grid"):
        args = _args(lan_scenario=name, dc=dc, lan_bw_scale=0.005, dc_planner=planner)
        edge.apply_lan_scenario(args)
        plan = dcplan.baseline_plan(spec, planner, dcplan.Options.from_config(Config(), tor=False))
        clusters, _ = lanmodel.two_level(plan)
        assert {a: tuple(m) for a, m in args.topology.clusters.items()} == {a: tuple(m) for a, m in clusters.items()}
        assert args.plan["planner"] == planner and args.plan["predicted_gbit"] == plan.prediction.gbit
        if planner == "atp" and spec.racks:
            assert len(clusters) == len(spec.racks)
    with pytest.raises(NetStormError, match="--dc-planner 'ring'"):
        edge.apply_lan_scenario(_args(lan_scenario=name, dc=dc, dc_planner="ring"))
