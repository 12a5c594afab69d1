"""Result documents: the STAR bound by hand, per-iteration limits from the rate log, the summary table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from netstorm.emulation import results, systems
from netstorm.emulation.cpu import parse_stat
from netstorm.emulation.errors import EmulationError
from netstorm.emulation.runner import TrainerLog
from netstorm.scenario import load

DATA = Path(__file__).parent / "data"


def test_star_bound_counts_every_route_through_the_busiest_link() -> None:
    # Chain 1-2-3, 10 Mbit/s everywhere, M = 1.25 MB = 10 Mbit. Hub 2: each link carries one flow each
    # way -> 1 s. Hub 1: 2->1 carries the gradients of 2 and 3 -> 2 s. So hub 2 at 1 s.
    rates = {(1, 2): 10.0, (2, 1): 10.0, (2, 3): 10.0, (3, 2): 10.0}
    assert results.star_bound_of_scaled(1_250_000, rates) == (pytest.approx(1.0), 2)
    # Make 3->2 slow (2 Mbit/s): hub 3 sends the sum to 2 and 1 over it (2 flows: 10 s); hubs 1 and 2
    # each need one flow over it (5 s): a tie, which goes to the lower id.
    rates[(3, 2)] = 2.0
    assert results.star_bound_of_scaled(1_250_000, rates) == (pytest.approx(5.0), 1)


def test_iteration_limits_follow_the_rates_in_force() -> None:
    scenario = load(DATA / "emu-4.toml")
    bounds = results.Bounds(2_500_000, 1.0)  # 20 Mbit
    log = [{"t": 0.0, "epoch": 0, "rates_mbit": {f"{a}->{b}": r for (a, b), r in scenario.rates().items()}},
           {"t": 5.0, "epoch": 1, "rates_mbit": {f"{a}->{b}": 10.0 for (a, b) in scenario.rates()}}]
    outcome = {"iteration_s": [3.0, 3.0, 3.0], "completed_at_s": [4.0, 7.0, 10.0]}
    # Initially the min cut is node 1's 20 Mbit/s out -> 1 s; after t=5 every link is 10 -> cut of
    # node 1 (one link) = 10 Mbit/s -> 2 s. Iterations start at 0, 4 and 7 s.
    assert results.iteration_limits(outcome, log, bounds, scenario) == [1.0, 1.0, 2.0]
    # An iteration from 4.5 s: 0.5 s at the old rates moves 10 of the 20 Mbit across node 1's cut (its
    # only link out, 20 Mbit/s, is the min cut), the rest at 10 Mbit/s takes 1 s more -> 1.5 s.
    straddling = {"iteration_s": [3.0, 3.0], "completed_at_s": [4.5, 7.5]}
    assert results.iteration_limits(straddling, log, bounds, scenario)[1] == pytest.approx(1.5, abs=1e-3)


def test_a_redraw_late_in_an_iteration_gives_the_limit_of_the_rates_averaged_over_it() -> None:
    # Node 1's only link out is the min cut: 20 Mbit/s until a re-draw at 419.8 s, 5 Mbit/s after. M = 20
    # Mbit. An iteration from 399.5 s: the old rates alone allow 1 s and end long before the re-draw, so
    # its limit is theirs, not the new rates' 4 s. One from 418.9 s: 0.9 s at 20 Mbit/s carries 18
    # Mbit, the last 2 Mbit take 0.4 s at 5 Mbit/s -> 1.3 s, between the old 1 s and the new 4 s.
    scenario = load(DATA / "emu-4.toml")
    bounds = results.Bounds(2_500_000, 1.0)
    slow = {f"{a}->{b}": (5.0 if a == 1 else 40.0) for (a, b) in scenario.rates()}
    log = [{"t": 0.0, "epoch": 0, "rates_mbit": {f"{a}->{b}": r for (a, b), r in scenario.rates().items()}},
           {"t": 419.8, "epoch": 1, "rates_mbit": slow}]
    assert results.window_limit_s(2_500_000, log, 0.0) == pytest.approx(1.0)
    assert results.window_limit_s(2_500_000, log, 420.0) == pytest.approx(4.0)
    assert results.window_limit_s(2_500_000, log, 399.5) == pytest.approx(1.0)
    straddling = {"iteration_s": [21.0, 1.6], "completed_at_s": [418.9, 420.5]}
    assert results.iteration_limits(straddling, log, bounds, scenario) == [pytest.approx(1.0),
                                                                           pytest.approx(1.3, abs=1e-3)]


def test_an_iteration_faster_than_its_limit_is_an_error_left_out_of_the_mean() -> None:
    result = _result()
    netstorm = result["systems"]["netstorm"]
    netstorm["iteration_s"] = [9.0, 1.5, 0.8, 1.5]
    netstorm["limit_s"] = [1.0, 1.0, 1.0, 1.0]
    errors = results.limit_errors(netstorm, result)
    assert errors == [{"iteration": 2, "iteration_s": 0.8, "limit_s": 1.0, "ratio": 0.8}]
    stats = results.system_stats(result)["netstorm"]
    assert stats["mean_s"] == pytest.approx(1.5) and stats["x_limit"] == pytest.approx(1.5)
    text = results.summary(result)
    assert "ERROR: netstorm: iteration 3 took 0.80 s, below its limit 1.00 s (0.80x)" in text
    assert "ERROR: star" not in text
    # At the limit, or below it only by the results' rounding, is no error.
    netstorm["iteration_s"] = [9.0, 1.0, 0.9999, 1.5]
    assert results.limit_errors(netstorm, result) == []
    # With compute time, the limit includes it.
    result["compute_s"] = 0.5
    assert [e["iteration"] for e in results.limit_errors(netstorm, result)] == [1, 2]


def test_a_step_that_failed_everywhere_is_no_limit_error_and_no_part_of_the_mean() -> None:
    result = _result()
    netstorm = result["systems"]["netstorm"]
    netstorm["iteration_s"] = [9.0, 1.5, 0.3, 2.5]
    netstorm["limit_s"] = [1.0, 1.0, 1.0, 1.0]
    netstorm["chaos"] = {"steps": [
        {"step": 1, "contributors": [1, 2], "failed": []},
        {"step": 2, "contributors": [], "failed": [1, 2]},   # the error arrived after 0.3 s
        {"step": 3, "contributors": [1], "failed": [2]},     # one DC failed, the other summed: it counts
    ]}
    assert results.failed_steps(netstorm) == {2}
    assert results.limit_errors(netstorm, result) == []
    assert results.system_stats(result)["netstorm"]["mean_s"] == pytest.approx(2.0)
    netstorm["chaos"]["steps"][1]["contributors"] = [1]  # had it summed somewhere, 0.3 s would be an error
    assert [e["iteration"] for e in results.limit_errors(netstorm, result)] == [2]


def _result() -> dict:
    def system(times: list[float], cpu: float = 20.0) -> dict:
        return {"kind": "netstorm", "iteration_s": times, "limit_s": [1.0] * len(times), "exact": True,
                "iterations_completed": len(times), "cpu": {"mean_pct": cpu, "run_pct": 5.0}}

    return {"format": 1, "scenario": "x", "dynamic": False, "seed": None, "bw_scale": 0.5, "time_scale": 1.0,
            "model": {"spec": "1M", "parameters": 10**6, "bytes": 4 * 10**6}, "iterations": 3, "compute_s": 0.0,
            "limit_s": 1.0, "star_bound_s": 4.0, "star_bound_hub": 2,
            "systems": {"netstorm": system([9.0, 1.5, 1.5]), "star": system([9.0, 6.0, 6.0]),
                        "gloo": system([9.0, 4.5, 4.5], cpu=97.0)}}


def test_summary_reports_ratios_to_limit_star_and_gloo_and_warns_when_cpu_bound() -> None:
    text = results.summary(_result())
    row = next(line for line in text.splitlines() if line.startswith("netstorm "))
    # Steady iterations only: 1.5 s -> 1.5x the limit, 4x faster than STAR (6 s), 3x faster than gloo.
    assert "1.50" in row and "4.00x" in row and "3.00x" in row
    assert "beat STAR by at most 4.00x" in text
    assert "WARNING: gloo" in text and "WARNING: netstorm" not in text


def test_summary_warns_when_the_hypervisor_took_cpu_time() -> None:
    result = _result()
    result["systems"]["netstorm"]["cpu"]["steal_pct"] = 6.5
    result["systems"]["star"]["cpu"]["steal_pct"] = 1.0
    text = results.summary(result)
    assert "WARNING: netstorm: the hypervisor took 6.5% of the host's CPU (steal time)" in text
    assert "WARNING: star" not in text


def test_proc_stat_totals_count_steal_apart() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert parse_stat("cpu  100 5 50 800 20 3 7 15 0 0\ncpu0 1 2 3\n") == (1000, 820, 15)
    assert parse_stat("cpu  100 0 50 850\n") == (1000, 850, 0)  # an old kernel without the later fields


def test_trainer_log_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tlog = TrainerLog(path, "3")
    tlog.poll()
    path.write_text('{"iteration": 0, "seconds": 1.0, "exact": true}\n{"iteration": 1, "sec')
    tlog.poll()
    assert [r["iteration"] for r in tlog.records] == [0]
    with path.open("a") as fh:
        fh.write('onds": 2.0, "exact": true}\nnot json\n')
    tlog.poll()
    assert [r.get("iteration") for r in tlog.records] == [0, 1, None]
    assert tlog.records[2]["exact"] is False
    json.dumps(tlog.records)


def test_system_names_parse_in_order_and_unknown_names_fail() -> None:
    assert [s.name for s in systems.parse("star, netstorm,star")] == ["star", "netstorm"]
    assert len(systems.parse("all")) == 9
    assert [s.name for s in systems.parse("star,star-mxnet")] == ["star", "star-mxnet"]
    assert systems.parse("star")[0].scheduler_flags()[:2] == ["--topology", "star"]
    assert systems.parse("star-mxnet")[0].scheduler_flags()[:2] == ["--topology", "star-mxnet"]
    assert systems.parse("lite")[0].scheduler_flags() == [
        "--topology", "fapt", "--enable-awareness", "false", "--enable-aux-path", "false"]
    with pytest.raises(EmulationError, match="unknown system"):
        systems.parse("netstorm,ring")


def test_scaling_efficiency_is_the_ratio_of_iteration_times() -> None:
    small, big = _result(), _result()
    small["nodes"], big["nodes"] = [1, 2, 3, 4, 5], list(range(1, 16))
    small["scenario"], big["scenario"] = "scale-5", "scale-15"
    # equal-capacity overlays: every DC has 4 links in at 10 Mbit/s
    small["initial_rates_mbit"] = {f"{i}->{j}": 10.0 for i in range(1, 6) for j in range(4)}
    big["initial_rates_mbit"] = {f"{i}->{j}": 10.0 for i in range(1, 16) for j in range(4)}
    big["systems"]["netstorm"]["iteration_s"] = [9.0, 2.0, 2.0]
    big["systems"]["netstorm"]["limit_s"] = [1.25] * 3
    lines = results.scaling([big, small])
    line = next(x for x in lines if x.startswith("netstorm (model 1M, synchronization only):"))
    # 5 DCs at 1.5 s, 15 DCs at 2.0 s: samples/s x(15/2)/(5/1.5) = 2.25 for 3x the DCs -> 0.75; the
    # limits (1.0 s and 1.25 s) allow at most 0.80.
    assert "x2.25 for x3.00" in line and "efficiency 0.75; at the min-cut limit M/λ it would be 0.80" in line
    # 2(n-1)·32 Mbit over 200 and 600 Mbit/s in: 1.28 s and 1.49 s, so no system beats (8/5)/(28/15) = 0.86
    assert "(1.28 s -> 1.49 s) 0.86" in line


def test_compute_time_enters_the_limit_serially_or_overlapped() -> None:
    result = _result()
    result["compute_s"] = 3.0
    assert results.with_compute(1.0, result) == 4.0
    result["overlap"] = True
    # forward (1 s) cannot overlap; backward (2 s) hides a shorter synchronization, not a longer one
    assert results.with_compute(1.0, result) == 3.0
    assert results.with_compute(2.5, result) == 3.5
    # 1.5 s steady against a 3 s limit cannot be: both steady iterations are errors of the run
    assert [e["iteration"] for e in results.limit_errors(result["systems"]["netstorm"], result)] == [1, 2]
    result["systems"]["netstorm"]["iteration_s"] = [9.0, 4.5, 4.5]
    row = next(line for line in results.summary(result).splitlines() if line.startswith("netstorm "))
    assert row.split()[1:4] == ["4.50", "3.00", "1.50"]  # 4.5 s steady against a 3 s limit
    assert "compute 3.0 s overlapped with synchronization" in results.summary(result)


def test_scaling_compares_only_runs_with_the_same_training_setup() -> None:
    runs = []
    for n, times, compute in ((5, [9.0, 4.0, 4.0], 3.0), (15, [9.0, 4.4, 4.4], 3.0), (15, [9.0, 2.0, 2.0], 0.0)):
        r = _result()
        r["nodes"], r["scenario"], r["compute_s"], r["overlap"] = list(range(1, n + 1)), f"scale-{n}", compute, True
        r["initial_rates_mbit"] = {f"{i}->{j}": 10.0 for i in range(1, n + 1) for j in range(4)}
        r["systems"] = {"netstorm": {**r["systems"]["netstorm"], "iteration_s": times}}
        runs.append(r)
    [line] = results.scaling(runs)  # the 15-DC run without compute has no 5-DC partner
    assert line.startswith("netstorm (model 1M, 3 s compute overlapped): 5 DCs (scale-5) 4.00 s/iteration -> "
                           "15 DCs (scale-15) 4.40 s/iteration")
    # limits 1 s + 2 s of backward hiding it: 3 s both; the all-reduce bounds 1.28 and 1.49 s hide too
    assert "efficiency 0.91; at the min-cut limit M/λ it would be 1.00" in line
    assert "(3.00 s -> 3.00 s) 1.00, which no system can beat with that compute time" in line


def test_overlap_is_passed_on_and_refused_for_a_one_tensor_model() -> None:
    import argparse

    from netstorm.commands import emulate
    from netstorm.emulation.runner import options_from_args

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    scenario = str(DATA / "emu-4.toml")
    opts = options_from_args(parser.parse_args([scenario, "--model", "1M/8", "--compute-s", "2", "--overlap"]))
    assert (opts.overlap, opts.compute_s, opts.model) == (True, 2.0, "1M/8")
    assert options_from_args(parser.parse_args([scenario, "--model", "alexnet"])).overlap is False
    with pytest.raises(EmulationError, match=r"--overlap needs a model of several layers .* '1M' is one tensor"):
        options_from_args(parser.parse_args([scenario, "--model", "1M", "--overlap"]))


def test_iterations_are_placed_by_the_trainers_stamps_after_their_compute() -> None:
    # The runner's view of an iteration's end lags by up to a poll; the trainers' stamps do not. Node 1's
    # link out (the min cut) is 20 Mbit/s until 5 s, then 10: M = 20 Mbit.
    scenario = load(DATA / "emu-4.toml")
    bounds = results.Bounds(2_500_000, 1.0)
    log = [{"t": 0.0, "epoch": 0, "rates_mbit": {f"{a}->{b}": r for (a, b), r in scenario.rates().items()}},
           {"t": 5.0, "epoch": 1, "rates_mbit": {f"{a}->{b}": 10.0 for (a, b) in scenario.rates()}}]
    outcome = {"iteration_s": [3.0, 3.0], "completed_at_s": [4.5, 7.9], "started_at_s": [1.0, 4.0]}
    assert results.iteration_starts(outcome) == [1.0, 4.0]
    # From 4.0 s: 1 s at 20 carries all 20 Mbit just as the rates drop -> 1 s (the poll's 4.5 s says 1.5).
    assert results.iteration_limits(outcome, log, bounds, scenario) == [1.0, pytest.approx(1.0)]
    # 0.5 s of compute first: the synchronization starts at 4.5 s -> 0.5 s at 20, 10 Mbit at 10 -> 1.5 s.
    result = {"compute_s": 0.5, "overlap": False}
    assert results.iteration_starts(outcome, result) == [1.5, 4.5]
    assert results.iteration_limits(outcome, log, bounds, scenario, result)[1] == pytest.approx(1.5)
    # Older results without stamps fall back to the runner's view.
    del outcome["started_at_s"]
    assert results.iteration_starts(outcome) == [0.0, 4.5]


def test_while_links_are_reshaped_each_is_credited_with_the_larger_of_its_rates() -> None:
    log = [{"t": 0.0, "epoch": 0, "rates_mbit": {"1->2": 20.0, "2->1": 8.0}},
           {"t": 2.0, "t_begin": 1.5, "epoch": 1, "rates_mbit": {"1->2": 10.0, "2->1": 16.0}}]
    segments = results.rate_segments(log)
    assert [(s.start, dict(s.rates)) for s in segments] == [
        (0.0, {(1, 2): 20.0, (2, 1): 8.0}), (1.5, {(1, 2): 20.0, (2, 1): 16.0}), (2.0, {(1, 2): 10.0, (2, 1): 16.0})]
    # M = 20 Mbit from 1.0 s: 2->1 decides: 0.5 s at 8 (4), 0.5 s at 16 (8), then 8 Mbit at 16 -> 1.5 s;
    # 1->2 (20, 20, 10) has carried 20 by 2.0 s.
    assert results.window_limit_s(2_500_000, log, 1.0) == pytest.approx(1.5)
