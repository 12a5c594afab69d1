"""The ``netstorm`` process-group backend and the DDP comm hook over a ``netstorm local`` cluster.

Ranks are real processes (torch.distributed keeps one default group per process): started by hand with
the env:// variables, or by torchrun. Every check compares with numbers computed independently: one
process training on the union of the shards, or each rank's inputs rebuilt from their seeds.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.trainers.launch import Cluster, descendants, local_cluster

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ranks:
    """Rank processes with their own environments; their stdout JSON lines in one queue."""

    def __init__(self, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], log_dir: Path) -> None:
        self.lines: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self.logs = [log_dir / f"rank-{i}.log" for i in range(len(argvs))]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.seen: list[tuple[int, dict[str, Any]]] = []
        """Every line read so far: ``until`` looks here first, so no wait misses another's line."""
        for i, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            with self.logs[i].open("wb") as log:
                process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            self.processes.append(process)
            threading.Thread(target=self._read, args=(i, process), daemon=True).start()

    def _read(self, index: int, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            try:
                record = json.loads(raw)
            except ValueError:
                record = {"text": raw.decode(errors="replace").strip()}
            self.lines.put((index, record if isinstance(record, dict) else {"value": record}))
        process.wait()
        self.lines.put((index, None))

    def until(self, predicate: Any, what: str, within: float,
              may_exit: frozenset[int] = frozenset()) -> tuple[int, dict[str, Any]]:
        """The first line (of any rank) ``predicate(index, record)`` accepts, or fail naming ``what``; a line
        accepted once is consumed. A rank in ``may_exit`` (one the test killed) may end its output first."""
        for position, (seen_index, seen_record) in enumerate(self.seen):
            if predicate(seen_index, seen_record):
                del self.seen[position]
                return seen_index, seen_record
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no {what} within {within:g} s; logs {[str(p) for p in self.logs]}")
            try:
                index, record = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if record is None and index in may_exit:
                continue
            if record is None:
                pytest.fail(f"rank {index} exited ({self.processes[index].poll()}) before any {what}: "
                            f"{self.logs[index].read_text()[-2000:]}")
            if predicate(index, record):
                return index, record
            self.seen.append((index, record))

    def wait(self, within: float) -> list[int]:
        deadline = time.monotonic() + within
        codes = []
        for i, process in enumerate(self.processes):
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {i} still running after {within:g} s: {self.logs[i].read_text()[-2000:]}")
        return codes

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def ranks_started() -> Iterator[list[Ranks]]:
    started: list[Ranks] = []
    yield started
    for ranks in started:
        ranks.stop()


def env_rank(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **extra}


def test_ddp_on_netstorm_matches_one_process_training_step_for_step(tmp_path: Path,
                                                                     ranks_started: list[Ranks]) -> None:
    """Three DCs of one rank each: rank 0's own comparison with one process (the example's --check) reports
    every step close, and, redone here from the saved parameters, every rank holds the same model after
    every step and the model moved. One run serves both checks: each rank start costs seconds of imports."""
    out = tmp_path / "out"
    out.mkdir()
    with local_cluster(3, tmp_path / "run", ready_timeout=90) as cluster:
        port = free_port()
        argv = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", "4", "--check"]
        ranks = Ranks([argv] * 3, [env_rank(r, 3, port, NETSTORM_SOCKET=cluster.socket(r + 1)) for r in range(3)],
                      tmp_path)
        ranks_started.append(ranks)
        checks = [ranks.until(lambda i, rec: i == 0 and "check" in rec, "check line", within=240)[1]
                  for _ in range(5)]
        assert ranks.wait(within=60) == [0, 0, 0], [log.read_text()[-2000:] for log in ranks.logs]
    assert [c["check"] for c in checks] == list(range(5))
    assert all(c["close"] for c in checks), checks
    runs = [np.load(out / f"rank-{r}.npz")["params"] for r in range(3)]
    assert len(runs[0]) == 5   # the initial parameters and those after each of the 4 steps
    for other in runs[1:]:
        assert np.array_equal(other, runs[0])
    assert not np.allclose(runs[0][0], runs[0][-1])


def test_fsdp2_over_two_dcs_of_two_ranks_each_matches_one_process(tmp_path: Path,
                                                                  ranks_started: list[Ranks]) -> None:
    """Two DCs of two ranks each (``trainers`` 2): each node sums its ranks, and FSDP2's ``fully_shard`` over
    the four (its reduce-scatters and all-gathers through the nodes) matches one process within 1e-5 (DDP
    with several ranks per DC: test_torch_launch.py's per-DC torchruns)."""
    out = tmp_path / "out"
    out.mkdir()
    with local_cluster(2, tmp_path / "run", flags=["--trainers", "2"], ready_timeout=90) as cluster:
        port = free_port()
        argv = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", "4", "--check",
                "--shard", "fsdp", "--rtol", "0", "--atol", "1e-5"]
        ranks = Ranks([argv] * 4, [env_rank(r, 4, port, NETSTORM_SOCKET=cluster.socket(1 + r // 2))
                                   for r in range(4)], tmp_path)
        ranks_started.append(ranks)
        checks = [ranks.until(lambda i, rec: i == 0 and "check" in rec, "check line", within=240)[1]
                  for _ in range(5)]
        assert ranks.wait(within=60) == [0, 0, 0, 0]
    assert all(c["close"] for c in checks), checks
    runs = [np.load(out / f"rank-{r}.npz")["params"] for r in range(4)]
    assert all(np.array_equal(other, runs[0]) for other in runs[1:])


def torchrun(nproc: int, script: Path, args: Sequence[str]) -> list[str]:
    return [str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(script), *args]


@pytest.mark.skipif(shutil.which(str(TORCHRUN)) is None, reason="torchrun is not installed beside python")
def test_torchrun_ranks_find_their_nodes_and_match_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with local_cluster(3, tmp_path / "run", ready_timeout=90) as cluster:
        # rank r finds DC r + 1's node from the template alone (one rank per DC)
        run = subprocess.run(torchrun(3, EXAMPLES / "ddp_train.py", ["--out", str(out), "--steps", "4", "--check"]),
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "NETSTORM_TORCH_SOCKET": str(cluster.run_dir / "node-{dc}.sock"),
                                  "NETSTORM_TORCH_RANKS_PER_DC": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MATCH: 3 ranks on netstorm" in run.stdout
    runs = [np.load(out / f"rank-{r}.npz")["params"] for r in range(3)]
    assert all(np.array_equal(other, runs[0]) for other in runs[1:])


@pytest.mark.skipif(shutil.which(str(TORCHRUN)) is None, reason="torchrun is not installed beside python")
def test_hybrid_hook_gloo_inside_netstorm_across_matches_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with local_cluster(2, tmp_path / "run", ready_timeout=90) as cluster:
        # ranks 0-1 are DC 1, ranks 2-3 DC 2; only each DC's leader (ranks 0 and 2) joins a node
        os.symlink(cluster.socket(1), cluster.run_dir / "rank-0.sock")
        os.symlink(cluster.socket(2), cluster.run_dir / "rank-2.sock")
        run = subprocess.run(torchrun(4, EXAMPLES / "hybrid_hook.py",
                                      ["--out", str(out), "--ranks-per-dc", "2", "--steps", "4", "--check"]),
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "NETSTORM_TORCH_SOCKET": str(cluster.run_dir / "rank-{rank}.sock")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MATCH: 4 ranks in 2 DCs" in run.stdout
    checks = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"check"')]
    assert len(checks) == 5 and all(c["close"] for c in checks)


def node_pid(cluster: Cluster, node_id: int) -> int:
    for pid in descendants(cluster.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"node" in argv and b"--id" in argv and argv[argv.index(b"--id") + 1] == str(node_id).encode():
            return pid
    raise AssertionError(f"no process of node {node_id}")


def test_a_dc_killed_mid_step_gives_the_others_a_torch_error_naming_dc_and_iteration(
        tmp_path: Path, ranks_started: list[Ranks]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # --keep-going: the survivors run on as they would on real hosts, so their error is the job's own
    # (the iteration lost with DC 3, or a sum without it), never the supervisor stopping them.
    with local_cluster(3, tmp_path / "run", flags=["--keep-going"], ready_timeout=90) as cluster:
        port = free_port()
        argv = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", "6",
                "--stall", "2:3", "--timeout", "60"]
        ranks = Ranks([argv] * 3, [env_rank(r, 3, port, NETSTORM_SOCKET=cluster.socket(r + 1)) for r in range(3)],
                      tmp_path)
        ranks_started.append(ranks)
        ranks.until(lambda i, rec: i == 2 and rec.get("stalled") == 3, "stall of rank 2 at step 3", within=240)
        for rank in (0, 1):  # both are past step 2 and wait in step 3's all-reduce
            ranks.until(lambda i, rec, r=rank: i == r and rec.get("step") == 2, f"step 2 of rank {rank}", within=60)
        os.kill(node_pid(cluster, 3), signal.SIGKILL)  # DC 3: its node and its rank
        ranks.processes[2].kill()
        errors: dict[int, dict[str, Any]] = {}
        while len(errors) < 2:   # each survivor's typed error within the wait's deadline, or the test fails
            index, record = ranks.until(lambda i, rec: i in (0, 1) and "error" in rec, "torch error", within=90,
                                        may_exit=frozenset({2}))
            errors[index] = record
        assert ranks.processes[0].wait(timeout=30) == 3 and ranks.processes[1].wait(timeout=30) == 3
    for rank, record in sorted(errors.items()):
        print(f"rank {rank}: {record['type']}: {record['error']}")  # shown with -s
    for rank, record in errors.items():
        message = record["error"]
        assert record["type"] in ("RuntimeError", "NetStormBackendError", "DistBackendError"), record
        assert f"DC {rank + 1}" in message and "iteration" in message, message
        assert "node 3" in message, message


def process_launch(pid: int) -> tuple[list[str], dict[str, str], str]:
    """A process's command line, environment and working directory: what restarts it as it was."""
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    pairs = (entry.split(b"=", 1) for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in entry)
    return argv, {k.decode(): v.decode() for k, v in pairs}, os.readlink(f"/proc/{pid}/cwd")


def wait_for_path(path: Path, within: float) -> None:
    """Until ``path`` exists (a restarted node binds its trainer socket; nothing to wait on but the file)."""
    deadline = time.monotonic() + within
    ready = threading.Event()
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {within:g} s")
        ready.wait(0.05)


@pytest.mark.timeout(900)
def test_with_on_dc_loss_continue_the_survivors_train_on_and_a_restarted_dc_rejoins_with_the_live_state(
        tmp_path: Path, ranks_started: list[Ranks]) -> None:
    """kill -9 of DC 3's node (and its rank) while the others wait in step 3's all-reduce: that collective
    runs again without DC 3 and the survivors train on. At step 4's boundary they wait for DC 3, whose node
    and rank are restarted with their command lines: its rank takes the live model, momentum buffers and
    step there, and from then on every rank holds the same parameters, bit for bit. They equal one process
    trained on every rank's batches, without DC 3's at step 3."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from train_mlp import FEATURES, flat, make_data, make_model, make_optimizer  # type: ignore[import-not-found]

    out = tmp_path / "out"
    out.mkdir()
    steps, died, back = 6, 3, 4
    restarted: list[subprocess.Popen[bytes]] = []
    with local_cluster(3, tmp_path / "run", flags=["--keep-going"], ready_timeout=90) as cluster:
        try:
            port = free_port()
            argv = [sys.executable, str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", str(steps),
                    "--stall", f"2:{died}", "--hold-for-rejoin", str(back), "--timeout", "120"]
            envs = [env_rank(r, 3, port, NETSTORM_SOCKET=cluster.socket(r + 1), NETSTORM_ON_DC_LOSS="continue")
                    for r in range(3)]
            ranks = Ranks([argv] * 3, envs, tmp_path)
            ranks_started.append(ranks)
            ranks.until(lambda i, rec: i == 2 and rec.get("stalled") == died, "stall of rank 2", within=240)
            for rank in (0, 1):
                ranks.until(lambda i, rec, r=rank: i == r and rec.get("step") == died - 1,
                            f"step {died - 1} of rank {rank}", within=60)
            node3 = node_pid(cluster, 3)
            node_argv, node_env, node_cwd = process_launch(node3)
            os.kill(node3, signal.SIGKILL)
            ranks.processes[2].kill()
            for rank in (0, 1):
                ranks.until(lambda i, rec, r=rank: i == r and rec.get("holding") == back, f"rank {rank} holding",
                            within=180, may_exit=frozenset({2}))
            # DC 3 comes back: its node, then its rank, each with its command line
            Path(cluster.socket(3)).unlink(missing_ok=True)
            with (tmp_path / "node-3-restarted.log").open("wb") as log:
                restarted.append(subprocess.Popen(node_argv, env=node_env, cwd=node_cwd, stdout=log, stderr=log,
                                                  stdin=subprocess.DEVNULL))
            wait_for_path(Path(cluster.socket(3)), within=60)
            (tmp_path / "again").mkdir()
            again = Ranks([argv], [envs[2]], tmp_path / "again")
            ranks_started.append(again)
            again.until(lambda i, rec: rec.get("rejoined") == back, "rank 2 rejoined", within=180)
            again.until(lambda i, rec: rec.get("step") == steps - 1, "last step of rank 2", within=180)
            for rank in (0, 1):
                ranks.until(lambda i, rec, r=rank: i == r and rec.get("step") == steps - 1, f"last step of rank {rank}",
                            within=180, may_exit=frozenset({2}))
            assert again.wait(within=60) == [0]
            assert ranks.processes[0].wait(timeout=60) == 0 and ranks.processes[1].wait(timeout=60) == 0
        finally:
            for process in restarted:
                process.kill()
                process.wait()
    saved = [np.load(out / f"rank-{r}.npz") for r in (0, 1, 2)]
    runs = [s["params"] for s in saved]
    assert np.array_equal(runs[0], runs[1])
    assert int(saved[2]["first"]) == back and len(runs[2]) == steps - back + 1
    # the restarted rank holds the survivors' parameters from its step boundary on, and their momentum
    np.testing.assert_array_equal(runs[2], runs[0][back:])
    np.testing.assert_array_equal(saved[2]["optimizer"], saved[0]["optimizer"])
    x, y = make_data(7, 3, 16, steps)  # the example's seed, ranks and batch
    model = make_model(0)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.tensor(runs[0][0]), model.parameters())
    opt = make_optimizer(model, 0.1)
    reference = [flat(model)]
    for step in range(steps):
        live = 2 if died <= step < back else 3
        opt.zero_grad()
        loss = torch.nn.CrossEntropyLoss()(model(x[step, :live].reshape(-1, FEATURES)), y[step, :live].reshape(-1))
        loss.backward()
        opt.step()
        reference.append(flat(model))
    np.testing.assert_allclose(runs[0], np.stack(reference), rtol=0, atol=1e-5)
