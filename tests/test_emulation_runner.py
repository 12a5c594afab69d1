"""The runner end to end with the gloo baseline: a result that obeys physics, plots, report, teardown."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from netstorm.emulation import netns

DATA = Path(__file__).parent / "data"

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.torch]


def test_gloo_on_emu4_writes_a_result_that_no_scheme_could_beat(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(DATA / "emu-4.toml"),
                           "--system", "gloo", "--iterations", "2", "--model", "1M", "--out", str(out),
                           "--plots", str(tmp_path / "plots")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    gloo = result["systems"]["gloo"]
    assert gloo["exact"] and gloo["iterations_completed"] == 2
    assert result["model"]["bytes"] == 4_000_000
    # emu-4's min cut is node 1's 20 Mbit/s out: 32 Mbit / 20 Mbit/s = 1.6 s.
    assert result["limit_s"] == pytest.approx(1.6)
    for seconds, limit in zip(gloo["sync_s"], gloo["limit_s"], strict=True):
        assert seconds >= 0.95 * limit
    assert "latency" in result["features"]["not_applied"]
    assert gloo["cpu"]["run_cpu_s"] > 0
    assert "iteration 2/2" in proc.stderr
    assert "gloo" in proc.stdout and "x limit" in proc.stdout
    # named for the result file, so several runs of one scenario can share a directory
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"result-iterations.png", "result-rates.png"}
    assert not [n for n in netns.list_namespaces() if result["run_id"] in n]

    report = subprocess.run([sys.executable, "-m", "netstorm.cli", "report", str(out), "--plots",
                             str(tmp_path / "again")], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert report.stdout.splitlines()[0] == proc.stdout.splitlines()[0]
    assert {p.name for p in (tmp_path / "again").iterdir()} == {"result-iterations.png", "result-rates.png"}


def test_netstorm_system_on_emu4_is_exact_and_records_its_policies(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(DATA / "emu-4.toml"),
                           "--system", "netstorm", "--iterations", "2", "--model", "1M", "--out", str(out),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ns = json.loads(out.read_text())["systems"]["netstorm"]
    assert ns["exact"] and ns["iterations_completed"] == 2
    for seconds, limit in zip(ns["sync_s"], ns["limit_s"], strict=True):
        assert seconds >= 0.95 * limit
    versions = ns["policy_versions"]
    assert len(versions["bound"]) >= 2 and all(isinstance(v, int) for v in versions["bound"].values())
    assert versions["policies"][0]["version"] == 0
    assert set(versions["bound"].values()) <= {p["version"] for p in versions["policies"]}
    # Every version's trees, as ``netstorm plan --json`` prints them: root -> node -> parent or null.
    assert sorted(ns["policy_trees"], key=int) == [str(p["version"]) for p in versions["policies"]]
    for trees in ns["policy_trees"].values():
        assert all(sorted(t) == ["1", "2", "3", "4"] and t[root] is None for root, t in trees.items())
    assert ns["limit_errors"] == []
    # Multi-root FAPT plans one tree per node at the initial rates, each spanning all four DCs.
    assert sorted(ns["trees"]) == ["1", "2", "3", "4"]
    assert all(sorted(t) == ["1", "2", "3", "4"] for t in ns["trees"].values())
    assert (tmp_path / "run" / "netstorm" / "scheduler.log").exists()
    # The progress display names the policy version bound to the latest iteration (re-plans may have
    # published newer ones by then) out of those published.
    shown = [int(v) for v in re.findall(r"policy v(\d+) \(of \d+ published\)", proc.stderr)]
    assert shown and set(shown) <= {p["version"] for p in versions["policies"]}


def test_paper_system_on_emu4_runs_the_paper_design_and_records_it(tmp_path: Path) -> None:
    from netstorm import scenario
    from netstorm.config import DESIGN_SWITCHES, PAPER_DESIGN
    from netstorm.planning.plan import plan

    out = tmp_path / "result.json"
    argv = ["emulate", str(DATA / "emu-4.toml"), "--system", "paper", "--iterations", "2", "--model", "1M",
            "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", *argv], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["command"].split() == ["netstorm", *argv]
    paper = result["systems"]["paper"]
    assert paper["exact"] and paper["iterations_completed"] == 2 and paper["limit_errors"] == []
    assert {k: paper["switches"][k] for k in DESIGN_SWITCHES} == PAPER_DESIGN
    assert paper["switches"]["enable_awareness"] and paper["switches"]["enable_aux_path"]
    # The first policy's trees are Algorithm 2's at the scenario's rates, as the result's planned trees.
    rates = scenario.load(str(DATA / "emu-4.toml")).rates()
    want = {str(r): {str(n): p for n, p in sorted(t.parent.items())}
            for r, t in plan(rates, packing=False, aux=False).trees.items()}
    assert paper["trees"] == want
    assert paper["policy_trees"]["0"] == want


def test_report_rejects_what_is_not_a_result(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "report", str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "not a netstorm emulate result" in proc.stderr
