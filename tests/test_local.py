"""``netstorm local``: children start, READY is printed, signals stop everything, failures are reported."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from netstorm.local import RUN_DIR_ENV

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
