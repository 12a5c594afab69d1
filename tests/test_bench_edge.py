"""The edge benchmark's parts: inputs whose float32 sums are exact in any order, CPU accounting read from
the kernel's files, the XDP maps' memory as the kernel charged it, the gloo path's exact all-reduce on a
namespace LAN, and the whole benchmark's report."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from netstorm.bench import edge
from netstorm.bench.edge_inputs import bound, contribution, reference
from netstorm.bench.hostcpu import busy_jiffies, softirq_threads, stat_cpu_seconds


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_float32_sums_of_the_inputs_equal_the_int64_reference_in_every_order(workers: int) -> None:
    scale, elements = 20, 5000
    parts = [contribution(3, 1, w, elements, scale, workers) for w in range(workers)]
    expected = reference(3, 1, workers, elements, scale)
    assert all(np.abs(p).max() <= bound(workers, scale) + 2.0**-scale for p in parts)
    for order in itertools.islice(itertools.permutations(range(workers)), 6):
        total = np.zeros(elements, np.float32)
        for w in order:
            total += parts[w]
        assert np.array_equal(total, expected)
    # the fixed-point grid: quantising again changes nothing
    q = parts[0].astype(np.float64) * 2.0**scale
    assert np.array_equal(q, np.rint(q))


def test_each_worker_and_iteration_draws_its_own_inputs() -> None:
    a = contribution(1, 0, 0, 100, 16, 4)
    assert np.array_equal(a, contribution(1, 0, 0, 100, 16, 4))
    assert not np.array_equal(a, contribution(1, 0, 1, 100, 16, 4))
    assert not np.array_equal(a, contribution(1, 1, 0, 100, 16, 4))


def test_busy_time_counts_user_system_irq_and_softirq_but_not_idle_or_steal() -> None:
    line = "cpu  100 5 40 9000 30 7 11 500 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert busy_jiffies(line) == 100 + 5 + 40 + 7 + 11


def test_a_process_cpu_is_its_utime_plus_stime() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    line = "4242 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 " + f"{3 * tick} {2 * tick} 0 0 20 0 1 0 0"
    assert stat_cpu_seconds(line) == 5.0
    assert stat_cpu_seconds(Path("/proc/self/stat").read_text()) > 0
    assert softirq_threads(), "the kernel runs one ksoftirqd per CPU"


def test_auto_picks_the_faster_exact_lan_path_and_never_gloo() -> None:
    results = {"xdp": {"wall_gbit": 1.0, "exact": True}, "userspace": {"wall_gbit": 2.0, "exact": True},
               "gloo": {"wall_gbit": 9.0, "exact": True}}
    assert edge.auto_pick(results) == "userspace"
    results["userspace"]["exact"] = False
    assert edge.auto_pick(results) == "xdp"
    assert edge.auto_pick({"gloo": results["gloo"]}) is None


def test_paths_are_checked() -> None:
    from netstorm.errors import NetStormError

    assert edge.parse_paths("gloo, xdp") == ["gloo", "xdp"]
    with pytest.raises(NetStormError, match="--paths"):
        edge.parse_paths("xdp,nccl")


def _scenario_args(**given: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    edge.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in given.items():
        setattr(args, key, value)
    return args


def test_a_scenario_dc_gives_the_workers_their_scaled_rates_precisions_and_the_planned_deployment() -> None:
    from netstorm import scenario
    from netstorm.config import Config
    from netstorm.emulation.lantier import planned_tiers

    args = _scenario_args(lan_scenario="lan-runtime-3", dc=1, lan_bw_scale=0.02, dc_planner="aleph")
    edge.apply_lan_scenario(args)
    spec = scenario.load("lan-runtime-3").node(1).lan
    assert spec is not None and args.workers == len(spec.workers) == 8
    assert args.rates == [(w.up_gbit * 0.02, w.down_gbit * 0.02) for w in spec.workers]
    assert args.gateway_gbit == spec.gateway_gbit * 0.02 and args.precision == ",".join(["fp32"] * 8)
    # the same deployment the emulator runs for this planner (the scheduler's planning core)
    tier = planned_tiers(scenario.load("lan-runtime-3"), Config(dc_planner="aleph"))[1]
    assert {a: tuple(m) for a, m in args.topology.clusters.items()} == {a: tuple(m) for a, m in tier.plan.clusters}
    mixed = _scenario_args(lan_scenario="lan-runtime-3", dc=2, dc_planner="precision-oblivious")
    edge.apply_lan_scenario(mixed)
    assert set(mixed.precision.split(",")) == {"fp16", "bf16", "int8"}
    assert mixed.plan["planner"] == "precision-oblivious" and mixed.plan["predicted_gbit"] > 0


def test_pace_rates_pace_each_worker_to_its_planned_rate_times_the_lans_scale() -> None:
    from netstorm.errors import NetStormError

    args = _scenario_args(lan_scenario="lan-precision", dc=2, lan_bw_scale=0.0025, dc_planner="pahina",
                          pace_rates=True)
    edge.apply_lan_scenario(args)
    assert args.plan["paced"] and sorted(args.pace_gbit) == list(range(9))
    assert args.pace_gbit == pytest.approx({int(w): r * 0.0025 for w, r in args.plan["rates"].items()})
    unpaced = _scenario_args(lan_scenario="lan-precision", dc=2, dc_planner="pahina")
    edge.apply_lan_scenario(unpaced)
    assert getattr(unpaced, "pace_gbit", None) is None and "paced" not in unpaced.plan
    with pytest.raises(NetStormError, match="--pace-rates needs"):   # the baseline allocates no rates
        edge.apply_lan_scenario(_scenario_args(lan_scenario="lan-precision", dc=2, pace_rates=True,
                                               dc_planner="precision-oblivious"))


def test_scenario_options_are_checked() -> None:
    from netstorm.errors import NetStormError

    with pytest.raises(NetStormError, match="needs --dc"):
        edge.apply_lan_scenario(_scenario_args(lan_scenario="lan-runtime-3"))
    with pytest.raises(NetStormError, match="describes no LAN"):
        edge.apply_lan_scenario(_scenario_args(lan_scenario="lan-runtime-3", dc=3))
    with pytest.raises(NetStormError, match="need --lan-scenario"):
        edge.apply_lan_scenario(_scenario_args(dc_planner="aleph"))


@pytest.mark.root
@pytest.mark.bcc
def test_kernel_map_bytes_is_what_the_kernel_charged_for_the_loaded_maps() -> None:
    from bpf.xdp import XdpAggregator
    from netstorm.bench.kernelmaps import kernel_map_bytes, map_memory
    from netstorm.lan.layout import EdgeLayout

    before = map_memory()
    small = XdpAggregator(EdgeLayout.uniform([10_000], scale=16, lanes=358), job=1, port=9490, expected=3,
                          timeout=1.0)
    try:
        with_small = map_memory()
        big = XdpAggregator(EdgeLayout.uniform([2_000_000], scale=16, lanes=358), job=1, port=9491,
                            expected=3, timeout=1.0)
        try:
            with_both = map_memory()
        finally:
            big.close()
    finally:
        small.close()
    small_maps = set(with_small) - set(before)
    big_maps = set(with_both) - set(with_small)
    assert small_maps and big_maps and not small_maps & big_maps
    # every map is charged at least its entries; the bigger model's maps cost more
    assert sum(with_both[m] for m in big_maps) > sum(with_small[m] for m in small_maps) > 0
    assert set(map_memory()) == set(before) and kernel_map_bytes() == sum(before.values())


@pytest.mark.root
@pytest.mark.torch
@pytest.mark.slow
def test_gloo_all_reduces_exactly_among_the_lan_workers(tmp_path: Path) -> None:
    from netstorm.bench.gloo_lan import run_gloo
    from netstorm.emulation.bridge_lan import Lan

    with Lan(3) as lan:
        out = run_gloo(lan, elements=30_000, iterations=3, scale=20, seed=5, log_dir=tmp_path)
    assert out["exact"] is True
    assert out["wall_seconds"] > 0 and out["ranks_cpu_seconds"] > 0
    assert out["host_cpu"].seconds >= out["ranks_cpu_seconds"]


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.torch
@pytest.mark.slow
def test_the_benchmark_reports_every_path_against_gloo(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from netstorm.bench.edge_report import markdown

    parser = argparse.ArgumentParser()
    edge.add_arguments(parser)
    saved = tmp_path / "edge-test.json"
    args = parser.parse_args(["--workers", "2", "--elements", "20000", "--iterations", "2", "--json",
                              "--out", str(saved)])
    assert edge.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    for name in edge.PATHS:
        r = out[name]
        assert r["exact"] is True
        for key in ("wall_gbit", "host_cpu_seconds_per_gb", "wall_gbit_vs_gloo"):
            assert r[key] > 0, (name, key)
        # the whole host's busy time comes from /proc/stat in clock ticks: a short window may see none
        assert r["host_busy_seconds_per_gb"] >= 0, name
        assert r["gradient_gb"] == 2 * 20000 * 4 * 2 / 1e9
    assert out["gloo"]["wall_gbit_vs_gloo"] == 1.0
    for key in ("gateway_cpu_seconds_per_gb", "pps_per_core", "ratio_per_core", "timer_events"):
        assert key in out["xdp"] and key in out["userspace"]
    assert out["kernel_map_bytes"] > 0 and out["auto_pick"] in edge.LAN_PATHS
    doc = json.loads(saved.read_text())
    # the command is the process's own argv (here pytest's, which may be empty past the program name)
    assert doc["command"].split()[0] == "netstorm" and doc["xdp"] == out["xdp"]
    table = markdown([saved])
    assert all(f"| edge-test.json | 2 | 0 % | 20,000 | 1500 | {name} (" in table for name in edge.PATHS)


def test_perf_report_lines_become_shares() -> None:
    from netstorm.bench.perfprof import parse_report

    text = ("    31.20%  [kernel.kallsyms]  [k] veth_xmit\n"
            "     9.05%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault\n"
            "\n# comment\n     0.61%  bpf_prog_6deef7357e7b4530_xdp_agg  [k] bpf_prog_6deef7357e7b4530_xdp_agg\n")
    rows = parse_report(text)
    assert [r["percent"] for r in rows] == [31.2, 9.05, 0.61]
    assert rows[0]["what"] == "[kernel.kallsyms] [k] veth_xmit"


def test_the_end_to_end_table_compares_iterations_with_and_without_lan_workers(tmp_path: Path) -> None:
    from netstorm.bench.edge_report import markdown
    from netstorm.emulation.results import system_stats

    base = json.loads((Path(__file__).parents[1] / "results" / "internet2-9.json").read_text())
    base["systems"] = {"netstorm": base["systems"]["netstorm"]}
    lan = json.loads(json.dumps(base))
    lan["features"]["lan_workers"] = {"1": 2, "2": 2}
    lan["systems"]["netstorm"]["iteration_s"] = [t * 1.5 for t in base["systems"]["netstorm"]["iteration_s"]]
    lan["systems"]["netstorm"]["edge_mode"] = {"1": "xdp (native)", "2": "xdp (native)"}
    (tmp_path / "edge-e2e.json").write_text(json.dumps(base))
    (tmp_path / "edge-e2e-lan.json").write_text(json.dumps(lan))
    table = markdown([tmp_path / "edge-e2e.json", tmp_path / "edge-e2e-lan.json"])
    ratio = system_stats(lan)["netstorm"]["mean_s"] / system_stats(base)["netstorm"]["mean_s"]
    assert f"{ratio:.2f}x as long as without (misses the 1.20x target)" in table
    assert "| edge-e2e-lan.json | 4 | netstorm | xdp (native) |" in table


def test_two_levels_deal_the_members_to_the_aggregators_in_turn() -> None:
    from netstorm.bench.edge_levels import topology
    from netstorm.errors import NetStormError

    assert topology(4, 1, 3).clusters == {}
    topo = topology(7, 2, 2)
    assert topo.clusters == {0: (2, 4, 6), 1: (3, 5)} and topo.levels == 2
    assert topo.gateway_mask() == 0b11  # the gateway hears the two aggregators only
    with pytest.raises(NetStormError, match="--aggregators"):
        topology(4, 2, 4)
    with pytest.raises(NetStormError, match="--levels"):
        topology(4, 3, 1)


def test_precisions_cycle_over_the_workers_and_unknown_ones_are_refused() -> None:
    from netstorm.bench.edge_levels import parse_precisions
    from netstorm.errors import NetStormError

    assert parse_precisions("fp32,fp16", 5) == ["fp32", "fp16", "fp32", "fp16", "fp32"]
    with pytest.raises(NetStormError, match="--precision"):
        parse_precisions("fp32,fp8", 2)


def test_the_mixed_reference_sums_what_each_precision_represents() -> None:
    from netstorm.bench.edge_levels import mixed_reference

    scale, lanes = 20, 100
    parts = [contribution(2, 0, w, 1000, scale, 4) for w in range(4)]
    assert np.array_equal(mixed_reference(parts, ["fp32"] * 4, lanes, scale), reference(2, 0, 4, 1000, scale))
    mixed = mixed_reference(parts, ["fp32", "fp16", "bf16", "int8"], lanes, scale)
    # fp16 keeps 11 significant bits, bf16 8, int8 7 plus a per-chunk scale: each moves the sum, by less
    # than its worker's rounding allows
    exact = reference(2, 0, 4, 1000, scale).astype(np.float64)
    bound = np.abs(parts[1]) * 2.0**-11 + np.abs(parts[2]) * 2.0**-8 + np.abs(parts[3]).max() * 2.0**-7 + 2.0**-scale
    assert not np.array_equal(mixed, exact.astype(np.float32))
    assert np.all(np.abs(mixed - exact) <= bound * 2)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("options", [["--levels", "2", "--aggregators", "2", "--workers", "5"],
                                     ["--precision", "fp32,fp16,bf16,int8", "--workers", "4"]],
                         ids=["two-levels", "mixed-precision"])
def test_the_userspace_path_is_exact_with_two_levels_and_mixed_precisions(
        options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    edge.add_arguments(parser)
    args = parser.parse_args(["--paths", "userspace", "--elements", "30000", "--iterations", "3", "--pool", "16",
                              "--json", *options])
    assert edge.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["userspace"]
    assert r["exact"] is True and r["pool"] == 16
    if "--levels" in options:
        assert r["levels"] == 2 and r["clusters"] == {"0": [2, 4], "1": [3]}
        assert set(r["aggregators"]) == {"0", "1"} and all(a["ready"] for a in r["aggregators"].values())
    else:
        assert r["precisions"] == ["fp32", "fp16", "bf16", "int8"]


@pytest.mark.root
@pytest.mark.bcc
def test_maps_only_reads_the_loaded_programs_maps_whatever_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    edge.add_arguments(parser)
    sizes = {}
    for elements in (200_000, 2_000_000):
        args = parser.parse_args(["--maps-only", "--elements", str(elements), "--pool", "64", "--json"])
        assert edge.run(args) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["pool_slots"] == 64 and doc["chunks"] > 64
        assert doc["kernel_map_bytes"] == sum(doc["maps"].values()) > 64 * doc["lanes"] * 4
        sizes[elements] = doc["kernel_map_bytes"]
    assert sizes[200_000] == sizes[2_000_000]  # the pool sets the maps, not the model


def test_the_planned_comparison_takes_means_over_repeats_against_flat_gloo_and_oblivious() -> None:
    from netstorm.bench.edge_report import planned

    def doc(planner: str, seconds: float, gbit: float, gloo: float | None = None) -> dict[str, object]:
        out: dict[str, object] = {"iterations": 2, "lan_scenario": {"scenario": "s", "dc": 1, "planner": planner},
                                  "userspace": {"wall_seconds": 2 * seconds, "wall_gbit": gbit, "exact": True}}
        if gloo is not None:
            out["gloo"] = {"wall_seconds": 2 * gloo, "wall_gbit": 1.0, "exact": True}
        return out

    table = planned({"a": doc("flat", 4.0, 1.0, gloo=2.0), "b": doc("aleph", 1.0, 4.0), "c": doc("aleph", 2.0, 2.0),
                     "d": doc("precision-oblivious", 4.0, 2.0), "e": {"workers": 4}})
    summary = table["s DC 1"]["summary"]
    assert summary["aleph"]["iteration_s"] == 1.5 and summary["aleph"]["aggregation_gbit"] == 3.0
    assert summary["aleph"]["less_time_than_flat"] == pytest.approx(1 - 1.5 / 4.0)
    assert summary["aleph"]["less_time_than_gloo"] == pytest.approx(1 - 1.5 / 2.0)
    assert summary["aleph"]["more_throughput_than_oblivious"] == pytest.approx(0.5)
    assert [r["file"] for r in table["s DC 1"]["runs"]["aleph"]] == ["b", "c"]
    assert summary["aleph"]["runs"] == 2 and summary["aleph"]["gbit_range"] == [2.0, 4.0]
    # a run whose results went down after the whole iteration is kept apart from the streamed ones
    whole = {**doc("flat", 8.0, 0.5), "results": "whole"}
    table = planned({"a": doc("flat", 4.0, 1.0, gloo=2.0), "w": whole})
    assert table["s DC 1"]["summary"]["flat"]["iteration_s"] == 4.0
    assert table["s DC 1"]["summary"]["flat whole"]["less_time_than_flat"] == pytest.approx(1 - 8.0 / 4.0)


def test_the_spread_sweep_orders_dcs_by_drawn_spread_and_finds_where_the_advantage_starts() -> None:
    from netstorm.bench.edge_report import sweep

    def doc(dc: int, rates: list[float], planner: str, seconds: float, gloo: float | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "iterations": 2, "userspace": {"wall_seconds": 2 * seconds, "wall_gbit": 1.0, "exact": True},
            "lan_scenario": {"scenario": "s", "dc": dc, "planner": planner, "rates_gbit": [[r, r] for r in rates]}}
        if gloo is not None:
            out["gloo"] = {"wall_seconds": 2 * gloo, "wall_gbit": 1.0, "exact": True}
        return out

    even, wide, mid, narrow = [2.0, 2.0], [1.0, 3.0], [1.5, 2.5], [1.8, 2.2]  # std/mean 0, 0.5, 0.25, 0.1
    docs = {"a": doc(1, wide, "flat", 4.0, gloo=3.0), "b": doc(1, wide, "aleph", 2.0), "c": doc(1, wide, "aleph", 1.0),
            "d": doc(2, even, "flat", 4.0, gloo=1.0), "e": doc(2, even, "aleph", 4.0),
            "f": doc(3, mid, "flat", 4.0, gloo=2.0), "g": doc(3, mid, "aleph", 1.8),
            "h": doc(4, narrow, "flat", 4.0, gloo=2.0), "i": doc(4, narrow, "aleph", 1.5)}
    result = sweep(docs)
    assert [(r["dc"], r["spread_drawn"]) for r in result["rows"]] == [(2, 0.0), (4, 0.1), (3, 0.25), (1, 0.5)]
    top = result["rows"][-1]
    assert top["aleph_s"] == 1.5 and top["runs"]["aleph"] == [2.0, 1.0] and top["gloo_s"] == 3.0
    assert top["less_time_than_gloo"] == pytest.approx(0.5) and top["less_time_than_flat"] == pytest.approx(1 - 1.5 / 4)
    assert top["less_time_than_gloo_range"] == pytest.approx([1 - 2.0 / 3.0, 1 - 1.0 / 3.0], abs=1e-4)
    # gloo is beaten from 0.1 on (by 25 %, 10 %, 50 %), the 20 % target only from 0.5 on (DC 3 misses it)
    assert result["beats_gloo_from"] == 0.1
    assert result["onset"] == 0.5
    docs["c"] = doc(1, wide, "aleph", 3.0)  # the widest spread now misses the target: no onset
    assert sweep(docs)["onset"] is None and sweep(docs)["beats_gloo_from"] == 0.1


def test_the_run_record_sums_each_runs_drops_and_keeps_its_command_and_load() -> None:
    from netstorm.bench.edge_report import run_record

    drops = {"ports": {"g": 2, "w0": 1}, "uplinks": {"w0": 4}, "udp_rcvbuf": {"g": 0, "w1": 3}}
    run = {"command": "netstorm bench edge --dc 2", "host": {"load_average_before": [1.0], "load_average_after": [2.0]},
           "lan_scenario": {"scenario": "s", "dc": 2},
           "userspace": {"retransmitted": 9, "stall_resends": 5, "resent_by_nack": 4, "lan_drops": drops}}
    record = run_record({"r.json": run, "other.json": {"workers": 4}})
    assert record["commands"] == {"r.json": "netstorm bench edge --dc 2"}
    assert record["host_load"] == {"r.json": {"before": [1.0], "after": [2.0]}}
    assert record["resends"] == {"r.json": {"retransmitted": 9, "stall_resends": 5, "resent_by_nack": 4,
                                            "queue_drops": 7, "udp_rcvbuf_drops": 3}}
