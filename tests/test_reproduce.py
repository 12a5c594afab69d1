"""``netstorm reproduce``: the figure runs, resuming, the progress view, the tables beside the paper.

The orchestration runs on a tiny profile with a stand-in launcher that writes result documents of
known times, so every number in a table can be checked by hand; one slow test runs a real emulation
through the same machinery.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from netstorm.commands.reproduce import write_report
from netstorm.emulation import figures, reproduce, systems
from netstorm.emulation.figures import Run
from netstorm.emulation.paper_numbers import PAPER, by_key

DATA = Path(__file__).parent / "data"

TINY = dataclasses.replace(
    figures.QUICK, name="tiny", iterations=3, roots=(1, 9), busy_bounds=(2,), queue_lengths=(1, 5), models=(),
    scales=("scale-5", "scale-15"), chunks_per_model=(), update_times=(20.0,), probe_chunk_nums=(),
    probe_fractions=())

# Seconds per steady iteration of each system, the same in every run unless a run overrides it.
TIMES = {"paper": 2.5, "paper-std": 3.0, "paper-lite": 4.0, "netstorm": 2.0, "std": 2.5, "lite": 3.0,
         "fapt": 3.2, "mst": 3.2, "bkt": 14.0, "star": 10.0, "star-mxnet": 13.0}
OVERRIDE = {("roots-1", "paper"): 5.0, ("roots-1", "netstorm"): 4.0, ("aux-b2-q5", "paper"): 2.0,
            ("scale-5", "netstorm"): 2.0, ("scale-15", "netstorm"): 2.5, ("scale-5", "paper"): 2.0,
            ("scale-15", "paper"): 2.0, ("update-20", "paper"): 3.0}


def _result(run: Run) -> dict[str, Any]:
    def system(name: str) -> dict[str, Any]:
        t = OVERRIDE.get((run.name, name), TIMES[name])
        times = [t + 5.0, *[t] * (run.iterations - 1)]  # the first iteration sets up connections
        return {"kind": "netstorm", "iteration_s": times, "limit_s": [1.0] * run.iterations, "exact": True,
                "iterations_completed": run.iterations, "wall_s": sum(times) + 10.0,
                "cpu": {"mean_pct": 50.0, "run_pct": 40.0, "steal_pct": 0.1}}

    nodes = 15 if run.scenario == "scale-15" else 5 if run.scenario == "scale-5" else 9
    return {"format": 1, "created": "2026-11-25T10:00:00Z", "scenario": run.scenario,
            "dynamic": run.scenario.endswith("dynamic"), "seed": None, "bw_scale": run.bw_scale,
            "time_scale": run.time_scale, "model": {"spec": run.model, "parameters": 10**6, "bytes": 4 * 10**6},
            "iterations": run.iterations, "compute_s": 0.0, "limit_s": 1.0, "star_bound_s": 8.0,
            "star_bound_hub": 6, "nodes": list(range(1, nodes + 1)),
            "initial_rates_mbit": {"1->2": 10.0}, "host": {"cpus": 2, "kernel": "test", "python": "3.11"},
            "features": {}, "systems": {name: system(name) for name in run.systems}}


class FakeLauncher:
    """Writes each run's result and the progress lines ``netstorm emulate`` prints."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail or set()

    def __call__(self, run: Run, out: Path, log: Path, on_line: Any) -> int:
        self.calls.append(run.name)
        log.write_text("")
        if run.name in self.fail:
            on_line(f"[{run.systems[0]}] FAILED: it broke")
            return 1
        for name in run.systems:
            on_line(f"     0.1s [{name}] starting (netstorm)")
            for k in range(1, run.iterations + 1):
                on_line(f"     1.0s [{name}] iteration {k}/{run.iterations}: 1.00 s (limit 1.00 s)")
        out.write_text(json.dumps(_result(run)))
        return 0


def _execute(tmp_path: Path, launcher: FakeLauncher, runs: list[Run] | None = None) -> tuple[Any, str]:
    stream = io.StringIO()
    outcome = reproduce.execute(TINY, runs or figures.runs(TINY), tmp_path, stream=stream, launcher=launcher,
                                out_label="out")
    return outcome, stream.getvalue()


def test_every_figure_run_is_listed_once_with_the_main_runs_first() -> None:
    runs = figures.runs(figures.QUICK)
    names = [r.name for r in runs]
    assert len(names) == len(set(names))
    assert names[:2] == [figures.STATIC, figures.DYNAMIC]
    # Every figure reads at least one run, and the main runs serve several.
    served = {f for r in runs for f in r.figures}
    assert served == set(figures.FIGURES)
    # The default points of the sweeps are the dynamic run, not repeated.
    assert "roots-9" not in names and "aux-b2-q1" not in names
    dynamic = runs[1]
    assert {"paper", "paper-std", "paper-lite", "netstorm", "std", "lite", "star", "star-mxnet", "bkt", "mst"} <= \
        set(dynamic.systems)
    assert dynamic.argv("x.json") == ["emulate", "internet2-9-dynamic", "--system", ",".join(dynamic.systems),
                                      "--iterations", "5", "--model", "1M", "--bw-scale", "0.25", "--time-scale",
                                      "0.06", "--out", "x.json"]
    # Fig. 19a reaches AlexNet's size x0.25 in the full profile: 15.3 M parameters, 61 MB.
    assert figures.FULL.models[-1] == "15.3M"
    assert figures.chunk_elements("1M", 576) == 1737


def test_runs_are_run_once_resumed_and_rerun_only_when_their_result_is_missing(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    outcome, text = _execute(tmp_path, launcher)
    names = [r.name for r in figures.runs(TINY)]
    assert launcher.calls == names
    assert sorted(outcome.results) == sorted(names) and not outcome.failed
    saved = json.loads((tmp_path / "static.json").read_text())
    assert saved["command"] == figures.runs(TINY)[0].command("out/static.json")
    assert saved["reproduce"] == {"profile": "tiny", "run": "static", "figures": ["13", "14", "19a"]}
    assert not list((tmp_path / ".partial").glob("*.json"))
    # Again: everything is there, nothing runs.
    again = FakeLauncher()
    outcome, text = _execute(tmp_path, again)
    assert again.calls == [] and sorted(outcome.resumed) == sorted(names)
    assert f"{len(names)} already in out, 0 to run" in text
    # One result lost: only that run runs.
    (tmp_path / "roots-1.json").unlink()
    third = FakeLauncher()
    _execute(tmp_path, third)
    assert third.calls == ["roots-1"]


def test_a_failed_run_is_reported_and_the_rest_go_on(tmp_path: Path) -> None:
    launcher = FakeLauncher(fail={"static"})
    outcome, text = _execute(tmp_path, launcher)
    assert "static" in outcome.failed and "static" not in outcome.results
    assert len(launcher.calls) == len(figures.runs(TINY))
    assert "run static FAILED" in text


def test_progress_names_figure_run_system_iteration_and_time_left(tmp_path: Path) -> None:
    _, text = _execute(tmp_path, FakeLauncher())
    lines = text.splitlines()
    total = len(figures.runs(TINY))
    assert any(f"Fig. 13 (also 14, 19a) · run static (1/{total}) · star-mxnet (7/7) · iteration 2/3" in line
               for line in lines)
    assert all(" left] " in line and line.startswith("[") for line in lines)


def test_time_left_shrinks_as_iterations_and_systems_complete() -> None:
    run = figures.runs(TINY)[0]
    estimator = reproduce.Estimator()
    view = reproduce.ProgressView(io.StringIO(), estimator, [], clock=lambda: 0.0)
    lefts = []
    for system in run.systems:
        for k in range(run.iterations + 1):
            view.state = reproduce.State(1, 1, run, system, k)
            lefts.append(view.left_s())
    assert lefts == sorted(lefts, reverse=True) and lefts[-1] == 0.0
    # The whole run: every system's start-up plus its iterations at the predicted time x the factor.
    view.state = reproduce.State(1, 1, run)
    assert view.left_s() == pytest.approx(sum(
        reproduce.START_UP_S + run.iterations * estimator.predicted_iteration_s(run, s) * reproduce.FIRST_FACTOR
        for s in run.systems))
    # A measured run teaches the factor: measured over predicted.
    result = _result(run)
    estimator.learn(run, result)
    measured = sum(sum(s["iteration_s"]) for s in result["systems"].values())
    predicted = sum(run.iterations * estimator.predicted_iteration_s(run, s) for s in run.systems)
    assert estimator.factor == pytest.approx(measured / predicted)
    assert estimator.start_up_s == pytest.approx(10.0)


def test_figure_tables_compute_the_paper_quantities_by_hand(tmp_path: Path) -> None:
    _execute(tmp_path, FakeLauncher())
    found = {r.name: reproduce.load_result(tmp_path / f"{r.name}.json") for r in figures.runs(TINY)}
    res = {k: v for k, v in found.items() if v is not None}

    def beside(report: figures.FigureReport, key: str) -> list[str]:
        quantity = by_key(key).quantity
        return next(row for row in report.tables[0].rows if row[0] == quantity)

    f13 = figures.fig13(res, TINY)
    assert beside(f13, "speedup_static") == [by_key("speedup_static").quantity, "up to 9.2x", "5.20x", "6.50x"]
    f15 = figures.fig15(res, TINY)
    assert beside(f15, "roots_9_over_1")[2:] == ["2.00x", "2.00x"]  # 5.0 / 2.5 and 4.0 / 2.0
    f16 = figures.fig16(res, TINY)
    assert beside(f16, "awareness_gain")[2:] == ["+25 %", "+17 %"]  # 1 - 3/4, 1 - 2.5/3
    f17 = figures.fig17(res, TINY)
    assert beside(f17, "aux_gain_max")[2] == "+50 %"  # paper-std 3.0 over 2.0 at (2, 5)
    assert beside(f17, "aux_best_cell")[2] == "2, 5"
    f18 = figures.fig18(res, TINY)
    assert beside(f18, "pro_over_mxnet")[2:] == ["5.20x", "6.50x"]
    f19b = figures.fig19b(res, TINY)
    assert beside(f19b, "scaling_efficiency")[2:] == ["1", "0.8"]
    f20 = figures.fig20(res, TINY)
    update = next(t for t in f20.tables if t.title.startswith("UPDATE_TIME"))
    assert update.rows == [["5 (default)", "2.50", "1.00x"], ["20", "3.00", "0.83x"]]
    assert beside(f20, "update_time_best")[2:] == ["fastest here: 5", "not run in this profile"]
    assert beside(f20, "chunk_size_best")[2] == "-"  # one point is no sweep
    # Every number the paper states is in some figure's first table.
    for number in PAPER:
        report = figures.FIGURES[number.figure](res, TINY)
        assert any(row[1] == number.stated for row in report.tables[0].rows), number.key


def test_report_holds_every_figure_its_charts_and_what_it_lacks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delitem(systems.SYSTEMS, "paper-lite", raising=False)
    monkeypatch.setattr(figures, "QUICK", TINY)
    outcome, _ = _execute(tmp_path, FakeLauncher(), [r for r in figures.runs(TINY) if r.name != "scale-15"])
    assert outcome.dropped["dynamic"] == ["paper-lite"]
    path = write_report(TINY, tmp_path)
    text = path.read_text()
    for figure in figures.FIGURES:
        assert f"## Fig. {figure}: " in text
    assert "![Fig. 13](fig13.png)" in text and (tmp_path / "fig13.png").stat().st_size > 0
    assert "runs without a result here (not run yet, or failed): `scale-15`" in text
    assert "run `dynamic` ran without `paper-lite`" in text
    assert "up to 9.2x" in text and "6.50x" in text
    assert "system runs (in" not in text  # no run was CPU-bound
    static = json.loads((tmp_path / "static.json").read_text())
    static["systems"]["bkt"]["cpu"]["mean_pct"] = 97.0
    (tmp_path / "static.json").write_text(json.dumps(static))
    assert "1 of 23 system runs (in 1 of 6 runs) had the host's CPU at 90 % or more" in \
        write_report(TINY, tmp_path, draw=False).read_text()
    static["systems"]["bkt"]["cpu"]["mean_pct"] = 50.0
    (tmp_path / "static.json").write_text(json.dumps(static))
    # Regenerating from the same results gives the same report, and not drawing the charts the same text.
    assert write_report(TINY, tmp_path, draw=False).read_text() == text


@pytest.mark.root
@pytest.mark.slow
def test_a_real_run_through_the_reproduce_machinery(tmp_path: Path) -> None:
    run = Run("tiny", str(DATA / "emu-4.toml"), ("netstorm",), 2, "0.2M", 1.0, figures=("13",))
    stream = io.StringIO()
    outcome = reproduce.execute(TINY, [run], tmp_path, stream=stream, out_label="out")
    assert not outcome.failed, (tmp_path / ".partial" / "tiny.log").read_text()[-2000:]
    result = json.loads((tmp_path / "tiny.json").read_text())
    ns = result["systems"]["netstorm"]
    assert ns["exact"] and ns["limit_errors"] == [] and len(ns["started_at_s"]) == 2
    assert ns["started_at_s"] == sorted(ns["started_at_s"])
    assert result["command"].startswith("netstorm emulate ") and result["command"].endswith("--out out/tiny.json")
    assert "· netstorm (1/1) · iteration 2/2" in stream.getvalue()
