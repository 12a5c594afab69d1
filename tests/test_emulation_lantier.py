"""The planned LAN tier in emulation: the emulator's plan is the one the scheduler pushes, the result
file's record of it, the demo passing ``--dc-planner`` on, and one emulated run with an aggregator worker
whose sums are exact."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from netstorm import lanreport
from netstorm.commands import demo
from netstorm.config import Config
from netstorm.emulation.lantier import planned_tiers, run_config
from netstorm.emulation.runner import compute_of, resize_lans
from netstorm.lan_scenario import uniform_lan
from netstorm.scenario import load
from scheduler.lanplanning import LanPlanning

DATA = Path(__file__).parent / "data"
SCENARIO = DATA / "emu-2-lantier.toml"


def test_the_emulator_plans_what_the_scheduler_pushes() -> None:
    scenario = load(SCENARIO)
    for planner in ("flat", "aleph", "pahina"):
        tiers = planned_tiers(scenario, run_config(["--dc-planner", planner]))
        assert sorted(tiers) == [2]   # DC 1 describes no LAN
        lan = scenario.node(2).lan
        assert lan is not None
        core = LanPlanning(Config(dc_planner=planner))
        core.report(lanreport.report_from_spec(2, lan))
        job = core.begin(2)
        assert tiers[2].plan == core.finish(job, core.compute(job))


def test_the_record_names_the_planner_its_aggregators_and_every_workers_aggregator() -> None:
    tier = planned_tiers(load(SCENARIO), run_config(["--dc-planner", "aleph"]))[2]
    record = tier.record()
    clusters, direct = tier.plan.two_level()
    assert record["planner"] == "aleph" and record["aggregators"] == sorted(clusters) != []
    assert sorted(record["assignment"], key=int) == ["0", "1", "2", "3"]
    for worker, head in record["assignment"].items():
        assert (int(worker) in direct) if head is None else int(worker) in clusters[head]
    flat = planned_tiers(load(SCENARIO), run_config([]))[2].record()   # dc_planner's default
    assert flat["planner"] == "flat" and flat["aggregators"] == [] and set(flat["assignment"].values()) == {None}


def test_the_demo_passes_the_dc_planner_on() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = demo.emulate_argv(parser.parse_args(["--scenario", "lan-hetero-4", "--dc-planner", "aleph"]))
    assert argv[0] == "lan-hetero-4" and argv[argv.index("--dc-planner") + 1] == "aleph"
    assert "--dc-planner" not in demo.emulate_argv(parser.parse_args([]))


def _demo_options(*flags: str) -> Any:
    from netstorm.commands import emulate
    from netstorm.emulation.runner import options_from_args

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    eparser = argparse.ArgumentParser()
    emulate.add_arguments(eparser)
    return options_from_args(eparser.parse_args(demo.emulate_argv(parser.parse_args(list(flags)))))


def test_demo_lan_workers_with_a_planner_plan_every_dc_of_the_default_scenario() -> None:
    """``./run demo --lan-workers N --dc-planner P``: internet2-9-dynamic describes no LAN, so each DC gets N
    default workers described, and each DC's tier is planned by P (not recorded as P and run flat)."""
    opts = _demo_options("--lan-workers", "3", "--dc-planner", "aleph")
    assert opts.plan_lans and run_config(opts.config_flags).dc_planner == "aleph"
    scenario, sources = resize_lans(load(opts.scenario), opts.lan_workers, planned=opts.plan_lans)
    assert sources == {dc: "default" for dc in range(1, 10)}
    for dc in scenario.nodes:
        assert dc.lan == uniform_lan(3) and dc.lan_workers == 3
    tiers = planned_tiers(scenario, run_config(opts.config_flags))
    assert sorted(tiers) == list(range(1, 10)) and {t.plan.planner for t in tiers.values()} == {"aleph"}
    # without a planner the demo's LAN stays what it was: unshaped, unplanned
    plain = _demo_options("--lan-workers", "3")
    assert not plain.plan_lans
    scenario, sources = resize_lans(load(plain.scenario), plain.lan_workers, planned=plain.plan_lans)
    assert sources == {dc: "none" for dc in range(1, 10)} and all(dc.lan is None for dc in scenario.nodes)
    assert planned_tiers(scenario, run_config(plain.config_flags)) == {}


def test_a_count_other_than_the_described_resizes_the_description() -> None:
    """lan-hetero-4 describes 8, 8 and 6 workers and DC 4 none: with 8 asked for and a planner, DCs 1 and 2
    keep their descriptions, DC 3's is resized, DC 4 gets default workers, and all four are planned."""
    original = load("lan-hetero-4")
    scenario, sources = resize_lans(original, 8, planned=True)
    assert sources == {1: "described", 2: "described", 3: "resized", 4: "default"}
    assert scenario.node(1).lan == original.node(1).lan and scenario.node(2).lan == original.node(2).lan
    assert scenario.node(3).lan == uniform_lan(8, original.node(3).lan)
    assert scenario.node(4).lan == uniform_lan(8)
    tiers = planned_tiers(scenario, run_config(["--dc-planner", "pahina"]))
    assert sorted(tiers) == [1, 2, 3, 4] and {t.plan.planner for t in tiers.values()} == {"pahina"}
    assert all(len(t.record()["assignment"]) == 8 for t in tiers.values())
    # the same count as described, no planner: the scenario as it was (DC 4 has no LAN workers)
    same, sources = resize_lans(original, None)
    assert same == original and sources == {1: "described", 2: "described", 3: "described"}


def test_a_described_lan_worker_computes_its_own_compute_s() -> None:
    """lan-hetero-4's DC 3 lists 0.05 s for its workers and 0.2 s for its last; a DC's own trainer, and a LAN
    worker no description covers, compute the run's --compute-s."""
    from netstorm.emulation.contributors import Contributor

    scenario = resize_lans(load("lan-hetero-4"), 8, planned=True)[0]
    listed = resize_lans(load("lan-hetero-4"), None)[0]
    assert [compute_of(listed, Contributor(f"3w{i}", 3, i, 10 + i), 0.7) for i in range(6)] == [0.05] * 5 + [0.2]
    assert compute_of(listed, Contributor("3", 3, None, 3), 0.7) == 0.7
    assert compute_of(scenario, Contributor("3w7", 3, 7, 30), 0.7) == pytest.approx((5 * 0.05 + 0.2) / 6)
    assert compute_of(scenario, Contributor("4w0", 4, 0, 40), 0.7) == 0.0     # the format's default worker
    unplanned = resize_lans(load("lan-hetero-4"), 8)[0]
    assert compute_of(unplanned, Contributor("4w0", 4, 0, 40), 0.7) == 0.7   # no description: the run's


@pytest.mark.root
@pytest.mark.slow
def test_lan_workers_with_a_planner_on_a_dc_without_a_description_plan_it(tmp_path: Path) -> None:
    """DC 1 of emu-2-lantier describes no LAN and DC 2 four workers; ``--lan-workers 2 --dc-planner aleph``
    plans both (DC 1's default LAN, DC 2's resized), each gateway is told its LAN, and the result says so."""
    out = tmp_path / "result.json"
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(SCENARIO), "--system", "netstorm",
                           "--iterations", "2", "--model", "100k", "--edge-mode", "userspace", "--lan-workers", "2",
                           "--dc-planner", "aleph", "--out", str(out), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ns = result["systems"]["netstorm"]
    assert ns["exact"] and ns["iterations_completed"] == 2
    assert result["features"]["lan_description"] == {"1": "default", "2": "resized"}
    assert ns["dc_planners"] == {"1": {"planner": "aleph"}, "2": {"planner": "aleph"}}
    assert sorted(ns["lan_tier"]) == ["1", "2"]
    for dc in (1, 2):
        node = (run_dir / "netstorm" / f"node-{dc}.log").read_text()
        assert "edge: aleph plan 0 deployed" in node   # the scheduler planned the LAN the gateway announced
    # DC 2's workers compute what its (resized) description says, DC 1's default workers nothing
    for label, compute in (("1w0", 0.0), ("1w1", 0.0), ("2w0", 0.2), ("2w1", 0.2), ("1", 0.0), ("2", 0.0)):
        recs = [json.loads(line) for line in (run_dir / "netstorm" / f"trainer-{label}.jsonl").read_text().splitlines()]
        assert [r["compute_s"] for r in recs] == pytest.approx([compute] * 2), label
        assert all(r["seconds"] - r["sync_s"] >= compute for r in recs), (label, recs)


@pytest.mark.root
@pytest.mark.slow
def test_an_emulated_run_with_a_planned_tier_is_exact_and_records_its_plan(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(SCENARIO), "--system", "netstorm",
                           "--iterations", "2", "--model", "100k", "--edge-mode", "userspace", "--dc-planner", "aleph",
                           "--out", str(out), "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ns = result["systems"]["netstorm"]
    assert ns["exact"] and ns["iterations_completed"] == 2
    assert result["features"]["dc_planner"] == "aleph"
    assert ns["dc_planners"] == {"2": {"planner": "aleph"}}
    expected = planned_tiers(load(SCENARIO), run_config(["--dc-planner", "aleph"]))[2]
    assert ns["lan_tier"] == {"2": expected.record()}
    for head in expected.aggregators:   # each aggregator worker's service ran and served its cluster
        log = (run_dir / "netstorm" / f"lan-aggregator-2-{head}.log").read_text()
        assert f"lan aggregator: worker {head} aggregates workers" in log
    for worker in sorted(set(range(4)) - set(expected.aggregators)):   # the others stand by for a re-plan
        log = (run_dir / "netstorm" / f"lan-aggregator-2-{worker}.log").read_text()
        assert f"lan aggregator: worker {worker} stands by" in log
    node = (run_dir / "netstorm" / "node-2.log").read_text()
    assert "edge: aleph plan 0 deployed" in node   # the scheduler's plan reached the gateway
    for label in ("2w0", "2w1", "2w2", "2w3"):
        recs = [json.loads(line) for line in (run_dir / "netstorm" / f"trainer-{label}.jsonl").read_text().splitlines()]
        assert len(recs) == 2 and all(r["exact"] for r in recs)
        # each spent the 0.2 s of compute its description gives before it pushed
        assert all(r["compute_s"] == 0.2 and r["seconds"] - r["sync_s"] >= 0.2 for r in recs), recs
