"""``netstorm local``: children start, READY is printed, signals stop everything, failures are reported."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from netstorm.local import RUN_DIR_ENV, Child, LocalCluster, LocalError

STARTUP = 120.0  # seconds; nine Python processes on a loaded 2-core machine


def processes_of(run_dir: Path) -> list[int]:
    """Pids of the children of the ``netstorm local`` run in ``run_dir`` (marked in their environment)."""
    mark = f"{RUN_DIR_ENV}={run_dir}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in environ:
            out.append(int(entry.name))
    return out


def node_pid(run_dir: Path, node: int) -> int:
    for pid in processes_of(run_dir):
        with contextlib.suppress(OSError):
            if f"--id\0{node}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no process for node {node}")


def start_local(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "netstorm.cli", "local", *args, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until_ready(proc: subprocess.Popen[str], timeout: float) -> list[str]:
    """stdout lines up to and including READY (a reader thread, so the deadline holds)."""
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("READY "):
                break
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(timeout):
        proc.kill()
        raise AssertionError(f"no READY within {timeout} s; stdout so far: {lines}")
    return lines


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow
def test_a_child_failing_at_startup_fails_the_run_with_its_log_tail(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "internet2-9", "--bw-scale", "-1")
    code, err = stop(proc)
    assert code == 1
    assert "scheduler exited with status 1" in err
    assert "--bw-scale must be positive, got -1.0" in err  # the tail of the scheduler's own log
    assert processes_of(run_dir) == []


@pytest.mark.slow
def test_ready_then_sigterm_stops_every_child(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "internet2-9", "--nodes", "1,2,3", "--heartbeat-interval", "0.5")
    try:
        lines = read_until_ready(proc, STARTUP)
        assert lines[-1] == f"READY {run_dir}"
        for node in (1, 2, 3):
            assert (run_dir / f"node-{node}.sock").exists()
            assert any(str(run_dir / f"node-{node}.sock") in line for line in lines)
        assert len(processes_of(run_dir)) == 4  # the scheduler and three nodes
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = stop(proc)
    assert code == 0, err
    assert processes_of(run_dir) == []
    assert not list(run_dir.glob("*.sock"))
    assert (run_dir / "scheduler.log").exists()


@pytest.mark.slow
def test_a_child_dying_after_ready_stops_the_rest_and_reports_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "internet2-9", "--nodes", "1,2")
    try:
        read_until_ready(proc, STARTUP)
        os.kill(node_pid(run_dir, 2), signal.SIGKILL)
        code, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert "node-2 was killed by signal 9" in err
    assert processes_of(run_dir) == []  # the supervisor stops (and reaps) the rest before it exits


def test_a_run_dir_too_long_for_unix_sockets_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / ("d" * 100)
    cluster = LocalCluster("internet2-9", [1, 2], run_dir)
    with pytest.raises(LocalError, match="longer than the 107 bytes a Unix socket allows"):
        asyncio.run(cluster.start())
    assert cluster.children == []
    assert not run_dir.exists()


def test_children_ignoring_sigterm_share_one_grace_period_before_sigkill(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import netstorm.local

    grace, stubborn = 1.0, 4
    monkeypatch.setattr(netstorm.local, "GRACE_S", grace)
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
             "time.sleep(60)"

    async def main() -> float:
        cluster = LocalCluster("internet2-9", [1, 2], tmp_path)
        for i in range(stubborn):
            process = await asyncio.create_subprocess_exec(sys.executable, "-c", ignore,
                                                           stdout=asyncio.subprocess.PIPE)
            cluster.children.append(Child(f"node-{i}", process, tmp_path / f"node-{i}.log"))
            assert process.stdout is not None
            async with asyncio.timeout(30):
                assert await process.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
        started = asyncio.get_running_loop().time()
        await cluster.stop()
        assert all(c.process.returncode == -signal.SIGKILL for c in cluster.children)
        return asyncio.get_running_loop().time() - started

    took = asyncio.run(main())
    # Waiting a fresh grace period per child would take stubborn * grace (4 s).
    assert grace <= took < (stubborn - 1) * grace


class Lines:
    """A pipe's lines, read by a thread, so a test waits for one with a deadline."""

    def __init__(self, pipe: object) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: object) -> None:
        for line in pipe:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: any(text in line for line in self.lines), timeout):
                raise AssertionError(f"no {text!r} within {timeout} s; lines so far: {self.lines}")


@pytest.mark.slow
def test_keep_going_runs_on_without_a_dead_node_until_the_last_one_dies(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_local(run_dir, "internet2-9", "--nodes", "1,2,3", "--keep-going", "--heartbeat-interval", "0.5")
    try:
        read_until_ready(proc, STARTUP)
        err = Lines(proc.stderr)
        os.kill(node_pid(run_dir, 3), signal.SIGKILL)
        err.wait_for("the job goes on without node-3", 60)
        scheduler_log = run_dir / "scheduler.log"
        deadline = 60.0
        while "node 3 is down" not in scheduler_log.read_text():  # the scheduler re-plans without it
            assert deadline > 0, scheduler_log.read_text()
            deadline -= 0.1
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
                raise AssertionError(f"netstorm local exited ({proc.returncode}): {err.lines}")
        assert proc.poll() is None and len(processes_of(run_dir)) == 3  # the scheduler and nodes 1 and 2
        assert (run_dir / "node-1.sock").exists() and (run_dir / "node-2.sock").exists()
        os.kill(node_pid(run_dir, 2), signal.SIGKILL)
        err.wait_for("the job goes on without node-2", 60)
        assert proc.poll() is None
        os.kill(node_pid(run_dir, 1), signal.SIGKILL)  # the last node: nothing is left to run
        assert proc.wait(timeout=60) == 1
        err.wait_for("node-1 was killed by signal 9", 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert processes_of(run_dir) == []
