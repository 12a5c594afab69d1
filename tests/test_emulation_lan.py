"""LAN workers in the WAN emulation: names and addresses, contributor ids, the fixed-point scale, and one
emulated run (2 DCs, DC 2's gateway aggregating 2 LAN workers in XDP) with exact sums and full teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netstorm.emulation import netns
from netstorm.emulation.contributors import contributors, edge_scale
from netstorm.emulation.errors import EmulationError
from netstorm.emulation.runner import with_lan_workers
from netstorm.emulation.topology import IFNAMSIZ, build_plan, run_of_namespace
from netstorm.lan.fixedpoint import quantize
from netstorm.scenario import load
from netstorm.trainers.synthetic import GradientPattern, coefficients, main

DATA = Path(__file__).parent / "data"
LAN = DATA / "emu-2-lan.toml"


def test_every_lan_gets_its_own_namespaces_interfaces_and_subnet() -> None:
    scenario = with_lan_workers(load(DATA / "emu-4.toml"), 3)
    plan = build_plan(scenario, "ab12")
    assert sorted(plan.lans) == [1, 2, 3, 4]
    names = list(plan.all_namespaces)
    assert len(names) == len(set(names)) == 1 + 4 + 4 * (1 + 3)
    assert all(n.startswith("nseab12-") and len(n) <= IFNAMSIZ for n in names)
    # --cleanup finds a killed run's LAN namespaces by the same run-id prefix as its DC namespaces
    assert {run_of_namespace(n) for n in names} == {"ab12"}
    ifaces = [name for lan in plan.lans.values()
              for name in (lan.bridge, lan.gateway_iface, lan.gateway_bridge_end, *lan.worker_ifaces,
                           *lan.worker_bridge_ends)]
    assert len(ifaces) == len(set(ifaces)) and all("ab12" in n and len(n) <= IFNAMSIZ for n in ifaces)
    addresses = [a for lan in plan.lans.values() for a in (lan.gateway_address, *lan.worker_addresses)]
    assert len(addresses) == len(set(addresses))
    # each LAN is one /24, gateway .1, and never overlaps the overlay, node or management ranges
    for lan in plan.lans.values():
        subnet = lan.gateway_address.rsplit(".", 1)[0]
        assert lan.gateway_address.endswith(".1") and all(a.startswith(subnet + ".") for a in lan.worker_addresses)
        assert subnet.startswith("10.103.")


def test_a_scenario_without_lan_workers_plans_no_lan() -> None:
    plan = build_plan(load(DATA / "emu-4.toml"), "ab12")
    assert plan.lans == {} and len(plan.all_namespaces) == 5


def test_more_lan_workers_than_the_worker_bitmap_holds_is_refused() -> None:
    with pytest.raises(EmulationError, match="at most 64 LAN workers"):
        build_plan(with_lan_workers(load(LAN), 65), "ab12")


def test_contributors_have_distinct_ids_after_the_dcs() -> None:
    plan = build_plan(with_lan_workers(load(DATA / "emu-4.toml"), 2), "ab12")
    got = [(c.label, c.id) for c in contributors(plan)]
    assert got[:4] == [("1", 1), ("2", 2), ("3", 3), ("4", 4)]
    assert got[4:] == [("1w0", 5), ("1w1", 6), ("2w0", 7), ("2w1", 8), ("3w0", 9), ("3w1", 10), ("4w0", 11),
                       ("4w1", 12)]


def test_the_edge_scale_holds_every_lan_sum_exactly_and_shrinks_for_big_lans() -> None:
    pattern = GradientPattern([("w", (66_000,))])
    for ids in ([3, 4], list(range(10, 74))):
        scale = edge_scale(ids)
        worst = 0.0
        for k in range(15):  # (c1, c2) repeat every 15 iterations
            total = np.zeros(pattern.parameters, np.float64)
            for i in ids:
                grads = pattern.allocate()
                pattern.fill(i, k, grads)
                total += grads["w"]
            worst = max(worst, float(np.abs(total).max()))
            lanes, overflow = quantize(total, scale)
            assert not overflow
            np.testing.assert_array_equal(lanes.astype(np.float64) / 2.0**scale, total)
        assert worst * 2.0 ** (scale + 1) < 2**31
    assert edge_scale([3, 4]) == 16 and edge_scale(list(range(10, 74))) < 16
    assert coefficients(0) == (1, 0)


def test_an_edge_trainer_needs_its_id_and_a_valid_job_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["--edge", "edge://10.0.0.1:9700?worker=0", "--model", "1000", "--out", str(out)]) == 2
    assert "--edge needs --dc" in capsys.readouterr().err
    assert main(["--edge", "edge://10.0.0.1:9700?worker=0", "--dc", "3", "--contributors", "0", "--out",
                 str(out)]) == 2
    with pytest.raises(SystemExit):
        main(["--edge", "edge://10.0.0.1:9700?worker=0", "--socket", "/x", "--dc", "3", "--contributors", "4"])


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.slow
@pytest.mark.parametrize("with_secret", [False, True], ids=["open", "job-secret"])
def test_an_emulated_run_with_lan_workers_is_exact_in_xdp_and_leaves_nothing_behind(tmp_path: Path,
                                                                                   with_secret: bool) -> None:
    """With a job secret every process of the run gets it: the TCP planes authenticate, and the LAN
    workers' datagrams carry the tokens the XDP program checks (a worker without it would never count)."""
    out = tmp_path / "result.json"
    run_dir = tmp_path / "run"
    secret = []
    if with_secret:
        made = subprocess.run([sys.executable, "-m", "netstorm.cli", "secret", str(tmp_path / "job.secret")],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        secret = ["--secret-file", str(tmp_path / "job.secret")]
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(LAN), "--system", "netstorm",
                           "--iterations", "2", "--model", "100k", "--edge-mode", "xdp", "--out", str(out),
                           "--run-dir", str(run_dir), *secret], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ns = result["systems"]["netstorm"]
    assert ns["exact"] and ns["iterations_completed"] == 2
    assert result["features"]["lan_workers"] == {"2": 2}
    mode = result["features"]["edge_mode"]["netstorm"]["2"]
    assert mode in ("xdp (native)", "xdp (generic)")
    assert ns["lan_workers"] == {"2": 2} and sorted(ns["per_lan_worker_iteration_s"]) == ["2w0", "2w1"]
    assert sorted(ns["per_dc_iteration_s"]) == ["1", "2"]
    # every contributor (2 DC trainers, 2 LAN workers, ids 1..4) checked the whole job's sum itself
    seen: dict[str, list[dict[str, object]]] = {}
    for label in ("1", "2", "2w0", "2w1"):
        lines = (run_dir / "netstorm" / f"trainer-{label}.jsonl").read_text().splitlines()
        seen[label] = [json.loads(line) for line in lines]
    assert {label: [r["dc"] for r in recs] for label, recs in seen.items()} == {
        "1": [1, 1], "2": [2, 2], "2w0": [3, 3], "2w1": [4, 4]}
    assert all(r["exact"] and r["workers"] == 4 and r["iteration"] == k
               for recs in seen.values() for k, r in enumerate(recs))
    assert "LAN aggregation: DC 2 xdp" in proc.stderr
    assert f"LAN workers per DC: DC 2: 2; gateway aggregation: netstorm DC 2 {mode}" in proc.stdout
    # teardown: no namespace, interface or process of this run is left
    run_id = result["run_id"]
    assert not [n for n in netns.list_namespaces() if run_id in n]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert run_id not in links
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(run_dir).encode() in cmdline:
            leftovers.append(pid)
    assert leftovers == []


def test_demo_lan_workers_reach_every_dc_of_the_emulated_scenario() -> None:
    import argparse

    from netstorm.commands import demo, emulate
    from netstorm.emulation.runner import options_from_args

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = demo.emulate_argv(parser.parse_args(["--lan-workers", "2", "--edge-mode", "userspace"]))
    eparser = argparse.ArgumentParser()
    emulate.add_arguments(eparser)
    opts = options_from_args(eparser.parse_args(argv))
    assert (opts.lan_workers, opts.edge_mode) == (2, "userspace")
    scenario = with_lan_workers(load(opts.scenario), opts.lan_workers)
    assert {dc.id: dc.lan_workers for dc in scenario.nodes} == {i: 2 for i in range(1, 10)}
    assert {dc.lan_workers for dc in with_lan_workers(load(LAN), None).nodes} == {0, 2}
    with pytest.raises(EmulationError, match="--lan-workers must be >= 0"):
        with_lan_workers(scenario, -1)


def test_the_gateway_mode_and_the_reason_for_a_fallback_come_from_the_schedulers_status() -> None:
    from netstorm import control
    from netstorm.emulation.schedrecord import SchedulerRecord

    def status(edge: dict[int, tuple[str, str]]) -> control.Status:
        return control.Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True, version=0, edge=edge)

    record = SchedulerRecord()
    assert record.edge_modes([2]) == {"2": "not started"}
    record.add_status(status({2: ("xdp (native)", "")}))
    assert record.edge_modes([2]) == {"2": "xdp (native)"}
    record.add_status(status({2: ("userspace", "cannot load: bpf_prog_load\n  EPERM")}))
    assert record.edge_modes([2]) == {"2": "userspace (XDP unavailable: cannot load: bpf_prog_load EPERM)"}
    record.add_status(status({}))
    assert record.edge_modes([1, 2]) == {"1": "not started",
                                         "2": "userspace (XDP unavailable: cannot load: bpf_prog_load EPERM)"}


@pytest.mark.root
def test_a_new_lan_removes_the_namespaces_of_lans_whose_process_was_killed() -> None:
    from netstorm.emulation.bridge_lan import Lan, sweep_dead

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()   # its pid is free now (the kernel would not hand it out again at once)
    orphan, mine = f"ns{dead.pid}x0b", f"ns{os.getpid()}x999b"
    for name in (orphan, mine):
        netns.add_namespace(name)
    try:
        with Lan(1):   # a new LAN sweeps first
            assert not netns.namespace_exists(orphan) and netns.namespace_exists(mine)
        assert sweep_dead() == []
    finally:
        for name in (orphan, mine):
            netns.delete_namespace(name)
