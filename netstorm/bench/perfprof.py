"""Where a LAN path's CPU goes: ``perf record`` of this process and the path's worker processes (every
thread, kernel work in their context included) over the measured window, summarised by shared object and
by symbol.

The shares say how much of the path is the Python interpreter, numpy, libc, the kernel's UDP and veth
path and the XDP program (``bpf_prog_*``). Python 3.11 frames show as the interpreter's C functions,
which is enough to tell per-packet interpreter work from kernel work.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FREQUENCY_HZ = 999
TOP = 25
_LINE = re.compile(r"^\s*([0-9.]+)%\s+(.*?)\s*$")


class PerfRecorder:
    """``start()`` ... ``stop()`` -> the summary (``summary``), recorded into ``path``."""

    def __init__(self, path: Path) -> None:
        if shutil.which("perf") is None:
            raise RuntimeError("--perf needs the perf tool (Debian: linux-perf)")
        self.path = path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, pids: Sequence[int] = ()) -> None:
        """Record this process and ``pids`` (the path's other processes: its workers)."""
        targets = ",".join(str(p) for p in (os.getpid(), *pids))
        self._proc = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(FREQUENCY_HZ), "-p", targets, "-o", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # perf opens its events before it writes the file header: wait for the file, with a deadline
        deadline = time.monotonic() + 10.0
        while not self.path.exists() and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> dict[str, Any]:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        _, err = self._proc.communicate(timeout=60)
        if self._proc.returncode not in (0, -signal.SIGINT):
            raise RuntimeError(f"perf record failed: {err.decode(errors='replace')[-500:]}")
        return summary(self.path)


def report(path: Path, sort: str) -> list[dict[str, Any]]:
    """``perf report`` sorted by ``sort`` (``dso`` or ``dso,sym``): rows of share and key."""
    out = subprocess.run(["perf", "report", "-i", str(path), "--stdio", "--no-children", "-q", "--sort", sort,
                          "--percent-limit", "0.5"], capture_output=True, text=True, timeout=300)
    return parse_report(out.stdout)


def parse_report(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            rows.append({"percent": float(m.group(1)), "what": " ".join(m.group(2).split())})
    return rows


def summary(path: Path) -> dict[str, Any]:
    return {"by_dso": report(path, "dso")[:TOP], "by_symbol": report(path, "dso,sym")[:TOP]}
