"""Klonet export: every overlay link once, each direction's own rate, latency and loss in Klonet's units."""

from __future__ import annotations

import json
import subprocess
import sys

from netstorm.emulation.klonet import to_klonet
from netstorm.scenario import load


def test_internet2_export_carries_each_direction() -> None:
    out = to_klonet(load("internet2-9-dynamic"), bw_scale=0.5)
    assert [n["name"] for n in out["nodes"]] == [f"h{i}" for i in range(1, 10)]
    assert len(out["links"]) == 13
    link = next(lk for lk in out["links"] if lk["name"] == "l5_7")
    # The file's rate for 5-7 is [20, 134] Mbit/s; halved: 10000 and 67000 kbit.
    assert link["source"] == "h5" and link["target"] == "h7"
    assert link["config"]["source"]["bw_kbit"] == "10000"
    assert link["config"]["target"]["bw_kbit"] == "67000"
    assert link["config"]["source"]["delay_us"] == "30000"
    assert float(link["config"]["target"]["loss_rate"]) == 0.02
    assert out["dynamics"]["period_s"] == 180.0
    assert out["dynamics"]["bw_kbit_range"] == [10000, 77500]


def test_cli_writes_the_file(tmp_path) -> None:
    target = tmp_path / "topo.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "export-klonet", "internet2-9", "-o", str(target)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(target.read_text())
    assert "dynamics" not in data
    assert {lk["name"] for lk in data["links"]} == {f"l{a}_{b}" for a, b in [
        (1, 2), (1, 3), (2, 3), (2, 5), (3, 4), (4, 5), (4, 6), (5, 7), (6, 7), (6, 8), (6, 9), (7, 8), (8, 9)]}
