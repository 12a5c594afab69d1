"""The loopback benchmark's measuring parts (/proc CPU times, process discovery) and its cluster scenario."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from netstorm.bench.loopback import cpu_seconds, host_cpu, memcpy_bandwidth, node_processes
from netstorm.scenario import parse
from netstorm.trainers.launch import _start_time, _stop, descendants, ring_scenario


@pytest.mark.parametrize("n", [2, 3, 4, 9, 15])
def test_ring_scenario_is_a_valid_connected_overlay(n: int) -> None:
    scenario = parse(tomllib.loads(ring_scenario(n)))
    assert scenario.node_ids == list(range(1, n + 1))
    for node in scenario.node_ids:
        assert len(scenario.neighbors(node)) >= (1 if n == 2 else 2)


def test_ring_scenario_needs_two_dcs() -> None:
    with pytest.raises(ValueError):
        ring_scenario(1)


def test_cpu_seconds_follow_the_process_clock() -> None:
    before_proc, before = cpu_seconds(os.getpid()), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        sum(range(10_000))
    burned = time.process_time() - before
    measured = cpu_seconds(os.getpid()) - before_proc
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs(measured - burned) <= 0.05 + 2 * tick


def test_descendants_and_node_processes_are_found_through_proc() -> None:
    # A child that starts a grandchild posing as `netstorm node --id 5`, and reports its pid.
    grandchild = "import time; time.sleep(60)"
    child_code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}, 'node', '--id', '5'])\n"
        "print(p.pid, flush=True)\n"
        "try:\n    p.wait()\nfinally:\n    p.kill()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild_pid = int(child.stdout.readline())
        assert descendants(child.pid) == [grandchild_pid]
        # Popen returns after the exec succeeded, so the grandchild's cmdline is already final.
        assert node_processes(child.pid) == {5: grandchild_pid}
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait(timeout=10)


def test_host_cpu_counts_our_own_work() -> None:
    busy0, total0 = host_cpu()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        sum(range(10_000))
    busy1, total1 = host_cpu()
    assert 0.25 * os.sysconf("SC_CLK_TCK") <= busy1 - busy0 <= total1 - total0


def test_stopping_a_process_also_ends_the_children_it_leaves_behind() -> None:
    # A parent that dies on SIGTERM without stopping its child, as a crashed supervisor would.
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    orphan = int(parent.stdout.readline())
    try:
        _stop(parent, timeout=10)
        assert parent.returncode == -signal.SIGTERM
        # The orphan was SIGKILLed; as init's child it is reaped at once, so its /proc entry goes away.
        deadline = time.monotonic() + 10
        while _start_time(orphan) is not None and Path(f"/proc/{orphan}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the orphan survived"
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_memcpy_bandwidth_is_a_plausible_rate() -> None:
    rate = memcpy_bandwidth(8_000_000)
    assert 1e8 < rate < 1e12  # between 100 MB/s and 1 TB/s: a copy, not a no-op nor a stall


@pytest.mark.slow
def test_bench_smoke_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "netstorm.cli", "bench", "loopback", "--nodes", "3", "--model-mb", "0.4",
         "--iterations", "40", "--chunk-size", "30000", "--run-dir", str(tmp_path / "run"), "--timeout", "60",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["exact"] is True
    assert result["model_bytes"] == 400_000
    assert len(result["iteration_s"]) == 40
    assert sorted(result["node_cpu_s_per_iteration"]) == ["1", "2", "3"]
    assert result["sync_bytes_per_s"] == pytest.approx(400_000 / (sum(result["sync_s"][1:]) / 39))
    assert all(s <= t for s, t in zip(result["sync_s"], result["iteration_s"], strict=True))
    assert result["node_cpu_s_per_mb"] == pytest.approx(result["node_cpu_s_per_iteration_mean"] / 0.4)
    assert 0 < result["sync_vs_memcpy"] < 1
    # the cluster's share of the host cannot exceed the host's busy share, up to /proc's tick resolution,
    # which depends on the machine (tick rate, CPUs, the window's length): a figure the benchmark reports
    slack = result["cpu_share_resolution"]
    assert 0 < result["cluster_cpu_share"] <= result["host_cpu_busy"] + slack
    assert f"+/- {slack:.1%}: /proc's tick resolution" in run.stdout
    assert "x memory-copy bandwidth" in run.stdout and "target" in run.stdout


@pytest.mark.slow
def test_tls_cost_runs_the_three_settings_one_after_the_other(tmp_path: Path) -> None:
    out = tmp_path / "tls.json"
    run = subprocess.run(
        [sys.executable, "-m", "netstorm.cli", "bench", "loopback", "--nodes", "3", "--model-mb", "0.4",
         "--iterations", "3", "--chunk-size", "30000", "--timeout", "60", "--tls-cost", "--rounds", "1",
         "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["exact"] is True
    assert [r["setting"] for r in result["runs"]] == ["plain", "secret", "secret+tls"]
    assert set(result["summary"]) == {"plain", "secret", "secret+tls"}
    assert "secret+tls" in run.stdout
