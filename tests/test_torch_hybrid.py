"""Compression in the hybrid DDP comm hook (gloo inside a DC, NetStorm across DCs) over a `netstorm local`
cluster of 2 DCs of 2 ranks: DDP trains with every rank identical, and every bucket the hook returned is
the compression's numpy replay of the DC sums (each DC's leader one contributor, error feedback per
bucket), divided by the job's 4 ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from netstorm.compression.options import VOTES, CompressionOptions
from netstorm.trainers.launch import local_cluster
from tests.test_torch_backend import ROOT, TORCHRUN, torchrun

pytestmark = [pytest.mark.torch, pytest.mark.slow]

Tensors = dict[str, np.ndarray]
DCS = {1: (0, 1), 2: (2, 3)}
"""Node id -> the global ranks of its DC; the first is the DC's leader."""
STEPS = 4
CASES = {
    "fediac": {"NETSTORM_FEDIAC_K": "0.1", "NETSTORM_FEDIAC_VOTES": "2"},
    "fediac-reuse": {"NETSTORM_FEDIAC_K": "0.1", "NETSTORM_FEDIAC_VOTES": "2", "NETSTORM_FEDIAC_GIA_REUSE": "2"},
    "topk": {"NETSTORM_FEDIAC_K": "0.05"},
    "fp16": {},
}


def _sum(pushes: list[Tensors], applied: int) -> Tensors:
    """What the nodes return: integers summed exactly, floats in float32, FediAC's roots' threshold."""
    out: Tensors = {}
    for name in pushes[0]:
        values = [np.asarray(p[name]) for p in pushes]
        if values[0].dtype.kind in "iu":
            out[name] = np.asarray(np.sum(values, axis=0, dtype=np.int64))
            if name == VOTES and applied:
                out[name] = (out[name] >= applied).astype(np.int64)
        else:
            out[name] = np.asarray(np.sum(values, axis=0, dtype=np.float32))
    return out


def replay(options: CompressionOptions, elements: int, index: np.ndarray, dc_sums: dict[int, np.ndarray],
           ) -> np.ndarray:
    """Every bucket's decoded sum as the leaders' stages compute it, from the DC sums, with numpy sums."""
    from netstorm.torch.compressed import BucketRounds
    from netstorm.torch.stage import ROUND_NAME

    applied = options.votes_of(len(DCS)) if options.method == "fediac" else 0
    leaders = {node: BucketRounds(options, ROUND_NAME, elements, seed=ranks[0]) for node, ranks in DCS.items()}
    for node, leader in leaders.items():
        leader.registered()
        leader.start(len(DCS), node, applied)
    out = []
    for call, bucket in enumerate(index):
        steps = {node: leader.iteration((int(bucket), elements, 0), dc_sums[node][call].copy())
                 for node, leader in leaders.items()}
        pushes = {node: next(s) for node, s in steps.items()}
        decoded: dict[int, np.ndarray] = {}
        while not decoded:
            total = _sum(list(pushes.values()), applied)
            for node, s in steps.items():
                try:
                    pushes[node] = s.send(total)
                except StopIteration as done:
                    decoded[node] = done.value
        assert len(decoded) == len(DCS) and np.array_equal(decoded[1], decoded[2])
        out.append(decoded[1])
    return np.stack(out)


@pytest.mark.skipif(shutil.which(str(TORCHRUN)) is None, reason="torchrun is not installed beside python")
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_hook_with_compression_trains_and_matches_the_numpy_replay(tmp_path: Path, case: str) -> None:
    method = case.split("-")[0]
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "NETSTORM_COMPRESSION": method, **CASES[case]}
    with local_cluster(2, tmp_path / "run", flags=["--compression", method], ready_timeout=90) as cluster:
        os.symlink(cluster.socket(1), cluster.run_dir / "rank-0.sock")
        os.symlink(cluster.socket(2), cluster.run_dir / "rank-2.sock")
        env["NETSTORM_TORCH_SOCKET"] = str(cluster.run_dir / "rank-{rank}.sock")
        run = subprocess.run(torchrun(4, ROOT / "tests" / "hybrid_ranks.py",
                                      ["--out", str(out), "--ranks-per-dc", "2", "--steps", str(STEPS)]),
                             capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [np.load(out / f"rank-{r}.npz") for r in range(4)]
    # trains: every step moves the model, the same at every rank of every DC
    params = ranks[0]["params"]
    assert params.shape[0] == STEPS + 1 and all(not np.array_equal(params[s], params[s + 1]) for s in range(STEPS))
    assert all(np.array_equal(r["params"], params) for r in ranks[1:])
    assert all(np.isfinite(r["losses"]).all() for r in ranks)
    index = ranks[0]["index"]
    assert len(index) == STEPS and all(np.array_equal(r["index"], index) for r in ranks)
    results = ranks[0]["result"]
    assert all(np.array_equal(r["result"], results) for r in ranks[1:])
    elements = results.shape[1]
    # gloo sums the two ranks of a DC: one float32 addition, the same in any order
    dc_sums = {node: ranks[a]["own"] + ranks[b]["own"] for node, (a, b) in DCS.items()}
    jobs = np.float32(sum(len(r) for r in DCS.values()))
    if method == "fp16":
        # each chunk's root adds the other DC's float16 value to its own and sends the sum as float16
        summed = results * jobs
        first, second = dc_sums[1], dc_sums[2]
        half = [(first.astype(np.float16).astype(np.float32) + second).astype(np.float16).astype(np.float32),
                (first + second.astype(np.float16).astype(np.float32)).astype(np.float16).astype(np.float32),
                (first.astype(np.float16) + second.astype(np.float16)).astype(np.float32)]
        assert np.all(np.any([summed == h for h in half], axis=0))
        assert not np.array_equal(summed, first + second)  # the wire did round
        return
    options = CompressionOptions.of(type("Config", (), {
        "compression": method, "fediac_k": float(CASES[case]["NETSTORM_FEDIAC_K"]), "fediac_bits": 0,
        "fediac_votes": int(CASES[case].get("NETSTORM_FEDIAC_VOTES", 0)),
        "fediac_gia_reuse": int(CASES[case].get("NETSTORM_FEDIAC_GIA_REUSE", 1))})())
    expected = replay(options, elements, index, dc_sums) / jobs
    assert np.array_equal(results, expected)
    sent = np.count_nonzero(results, axis=1)
    assert 0 < sent[-1] < elements  # sparse after the first step
