"""``netstorm emulate`` with LAN workers and ``--compression fediac`` (and ``fediac:gia_reuse=2``): the
synthetic trainers of both DCs and DC 2's two LAN workers run the same rounds (the LAN workers over
per-round wires through the XDP gateway), so every contributor reports the same GIA each iteration, over
the same four contributors, with the same rounds (a reused GIA's iteration one round, no vote), and the LAN
workers put no bytes on WAN links."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.bcc, pytest.mark.slow]

LAN = Path(__file__).parent / "data" / "emu-2-lan.toml"


@pytest.mark.parametrize(("compression", "iterations", "round_trips"),
                         [("fediac", 3, [2, 2, 2]), ("fediac:gia_reuse=2", 4, [2, 1, 2, 1])])
def test_lan_workers_run_fediac_rounds_in_an_emulated_job(tmp_path: Path, request: pytest.FixtureRequest,
                                                          compression: str, iterations: int,
                                                          round_trips: list[int]) -> None:
    out = tmp_path / "result.json"
    # a short run directory: the nodes' unix socket paths hold it and the row's name (at most 107 bytes)
    run_dir = Path(tempfile.mkdtemp(prefix="nslf"))
    request.addfinalizer(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(LAN), "--system", "netstorm",
                           "--compression", compression, "--fediac-bits", "10", "--iterations", str(iterations),
                           "--model", "100k", "--edge-mode", "xdp", "--out", str(out), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {label: [json.loads(line) for line in
                       (run_dir / f"netstorm+{compression}" / f"trainer-{label}.jsonl").read_text().splitlines()]
               for label in ("1", "2", "2w0", "2w1")}
    assert all(len(recs) == iterations and all("error" not in r for r in recs) for recs in records.values()), records
    for k in range(iterations):
        gias = {label: recs[k]["gia"] for label, recs in records.items()}
        assert len(set(gias.values())) == 1 and 0 < gias["1"] < 100_000, gias
        assert all(recs[k]["workers"] == 4 and recs[k]["round_trips"] == round_trips[k] for recs in records.values())
    assert all(r["wan_bytes"] == 0 and len(r["round_s"]) == r["round_trips"] for label in ("2w0", "2w1")
               for r in records[label])
    assert all(r["wan_bytes"] > 0 for label in ("1", "2") for r in records[label])
