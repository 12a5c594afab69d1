"""The gloo baseline's trainer on loopback: exact sums, serial and overlapped with backward."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_sum_exactly(tmp_path: Path, overlap: bool) -> None:
    store = f"127.0.0.1:{_free_port()}"
    procs = []
    for rank in range(2):
        argv = [sys.executable, "-m", "netstorm.emulation.gloo_trainer", "--rank", str(rank), "--world", "2",
                "--dc", str(rank + 1), "--store", store, "--address", "127.0.0.1", "--model", "100k/4",
                "--iterations", "3", "--compute-s", "0.3", "--timeout", "60", "--out", str(tmp_path / f"{rank}.jsonl")]
        procs.append(subprocess.Popen([*argv, *(["--overlap"] if overlap else [])], stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    for rank in range(2):
        records = [json.loads(line) for line in (tmp_path / f"{rank}.jsonl").read_text().splitlines()]
        assert [(r["iteration"], r["exact"], r["dc"]) for r in records] == [(k, True, rank + 1) for k in range(3)]
        assert all(r["seconds"] >= 0.3 and 0 <= r["sync_s"] <= r["seconds"] for r in records), records
