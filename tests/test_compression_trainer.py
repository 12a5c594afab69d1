"""The synthetic trainer with each compression through real nodes: what every line reports."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from netstorm.trainers.launch import Trainers, local_cluster
from netstorm.trainers.synthetic import main


def test_compression_options_are_validated_before_connecting(tmp_path: Path) -> None:
    sock = str(tmp_path / "nowhere.sock")
    assert main(["--socket", sock, "--compression", "fediac", "--fediac-bits", "40"]) == 2
    assert main(["--socket", sock, "--compression", "fediac", "--overlap"]) == 2
    assert main(["--socket", sock, "--compression", "topk", "--rejoinable"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fediac", "topk", "fp16"])
def test_synthetic_trainer_reports_each_compression(tmp_path: Path, method: str) -> None:
    iterations = 4
    with local_cluster(3, tmp_path / "run", flags=["--chunk-size", "20000"], ready_timeout=90) as cluster:
        ids = list(cluster.node_ids)
        argvs = [[sys.executable, "-m", "netstorm.trainers.synthetic", "--socket", cluster.socket(node),
                  "--model", "60k", "--iterations", str(iterations), "--timeout", "60", "--max-failures", "1",
                  "--compression", method, "--fediac-k", "0.1", "--fediac-votes", "1",
                  "--contributor-sum", str(sum(ids))] for node in ids]
        records: dict[int, list[dict[str, Any]]] = {node: [] for node in ids}
        codes: dict[int, int | None] = {}
        with Trainers(argvs, tmp_path) as trainers:
            while len(codes) < len(ids):
                line = trainers.next_line(timeout=120)
                if line.record is None:
                    codes[ids[line.index]] = line.returncode
                else:
                    records[ids[line.index]].append(line.record)
    assert codes == dict.fromkeys(ids, 0), (codes, records)
    for node, got in records.items():
        assert [r["iteration"] for r in got] == list(range(iterations)), got
        assert all(r["compression"] == method and r["wan_bytes"] > 0 for r in got), got
        if method == "fp16":  # small integers: float16 sums stay exact
            assert all(r["exact"] is True and r["round_trips"] == 1 for r in got), got
            continue
        # one iteration's decoded sum leaves out what error feedback carries over: not a bounded error
        assert all(r["exact"] is None and math.isfinite(r["rel_error"]) and (r["gia"] > 0 or r["dense"])
                   and r["cum_rel_error"] >= 0 and len(r["round_s"]) == r["round_trips"] for r in got), got
        assert [r["round_trips"] for r in got] == ([1] + [2] * (iterations - 1) if method == "fediac"
                                                   else [2] * iterations), (node, got)
        if method == "fediac":
            assert got[0]["dense"] and got[0]["rel_error"] == 0.0 and 2 < got[0]["bits"] <= 24
        gias = {tuple(r["gia"] for r in got) for got in records.values()}
        assert len(gias) == 1  # the same GIA sizes at every DC
