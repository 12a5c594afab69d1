"""``netstorm emulate`` with LAN workers and ``--compression fediac``: the synthetic trainers of both DCs
and DC 2's two LAN workers run the same rounds (the LAN workers over per-round wires through the XDP
gateway), so every contributor reports the same GIA each iteration, over the same four contributors, and
the LAN workers put no bytes on WAN links."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.bcc, pytest.mark.slow]

LAN = Path(__file__).parent / "data" / "emu-2-lan.toml"


def test_lan_workers_run_fediac_rounds_in_an_emulated_job(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(LAN), "--system", "netstorm",
                           "--compression", "fediac", "--fediac-bits", "10", "--iterations", "3", "--model", "100k",
                           "--edge-mode", "xdp", "--out", str(out), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {label: [json.loads(line) for line in
                       (run_dir / "netstorm+fediac" / f"trainer-{label}.jsonl").read_text().splitlines()]
               for label in ("1", "2", "2w0", "2w1")}
    assert all(len(recs) == 3 and all("error" not in r for r in recs) for recs in records.values()), records
    for k in range(3):
        gias = {label: recs[k]["gia"] for label, recs in records.items()}
        assert len(set(gias.values())) == 1 and 0 < gias["1"] < 100_000, gias
        assert all(recs[k]["workers"] == 4 and recs[k]["round_trips"] == 2 for recs in records.values())
    assert all(r["wan_bytes"] == 0 and len(r["round_s"]) == 2 for label in ("2w0", "2w1") for r in records[label])
    assert all(r["wan_bytes"] > 0 for label in ("1", "2") for r in records[label])
