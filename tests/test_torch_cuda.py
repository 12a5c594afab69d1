"""The device check: DDP with its model on a GPU over the ``netstorm`` backend, whose collectives stage
CUDA tensors through host memory. It runs where a GPU is; elsewhere there is nothing to check (the CPU
path is the rest of the torch tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from netstorm.trainers.launch import local_cluster
from tests.test_torch_backend import EXAMPLES, Ranks, env_rank, free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this host: the device check "
                                 "runs on a GPU machine")]


def test_ddp_on_a_gpu_matches_one_process_training(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with local_cluster(2, tmp_path / "run", ready_timeout=90) as cluster:
        port = free_port()
        argv = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", "4", "--check",
                "--device", "cuda"]
        ranks = Ranks([argv] * 2, [env_rank(r, 2, port, NETSTORM_SOCKET=cluster.socket(r + 1)) for r in range(2)],
                      tmp_path)
        try:
            checks = [ranks.until(lambda i, rec: i == 0 and "check" in rec, "check line", within=240)[1]
                      for _ in range(5)]
            assert ranks.wait(within=60) == [0, 0], [log.read_text()[-2000:] for log in ranks.logs]
        finally:
            ranks.stop()
    assert all(c["close"] for c in checks), checks
    runs = [np.load(out / f"rank-{r}.npz")["params"] for r in range(2)]
    assert np.array_equal(runs[0], runs[1]) and not np.allclose(runs[0][0], runs[0][-1])
