"""The planned LAN tier in emulation: the emulator's plan is the one the scheduler pushes, the result
file's record of it, the demo passing ``--dc-planner`` on, and one emulated run with an aggregator worker
whose sums are exact."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from netstorm import lanreport
from netstorm.commands import demo
from netstorm.config import Config
from netstorm.emulation.lantier import planned_tiers, run_config
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
