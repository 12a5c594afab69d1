"""Host CPU spent on a path over a measured window: its processes and the kernel's work for them.

Two figures per window:
- ``seconds``: the CPU time of the path's own processes (this one and any it names, such as a two-level
  LAN's aggregators; user + system, every thread; with tick
  accounting a tick that lands in softirq or irq context is charged to the task it interrupted, and on
  veth the receive side's softirq runs in the sending task's context) plus the CPU time of the kernel's
  softirq threads (``ksoftirqd/N``, where softirq work goes once it piles up). That is every process of
  the path and the kernel's packet work, and on a host shared with other work it counts none of theirs.
- ``host_seconds``: the whole host's busy time from /proc/stat (user, nice, system, irq, softirq), which
  also counts anything else the host runs during the window; on a quiet host the two agree.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def busy_jiffies(text: str) -> int:
    """Busy jiffies of all CPUs from /proc/stat's first line: user, nice, system, irq, softirq (not idle,
    iowait or steal, which another guest's work takes from this one)."""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return user + nice + system + irq + softirq


def stat_cpu_seconds(text: str) -> float:
    """utime + stime of a /proc/PID/stat line, in seconds."""
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def softirq_threads() -> list[int]:
    """Pids of the kernel's ``ksoftirqd/N`` threads."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("ksoftirqd/"):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _threads_seconds(pids: Iterable[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            continue
    return total


def _self_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _host_seconds() -> float:
    return busy_jiffies(Path("/proc/stat").read_text()) / TICK


@dataclasses.dataclass(frozen=True)
class CpuWindow:
    seconds: float
    """CPU-seconds of the path's processes and the kernel's softirq threads over the window."""
    host_seconds: float
    """The whole host's busy CPU-seconds over the window (includes other work on the host)."""
    wall: float


class HostCpu:
    """``start()`` ... ``stop(extra)`` around the measured work of this process (every thread) and of the
    processes ``pids`` (alive through the window); ``extra`` adds CPU-seconds that other processes of the
    path measured for themselves over the window."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self._others = [*softirq_threads(), *pids]
        self._t0 = self._own0 = self._others0 = self._host0 = 0.0

    def add(self, pids: Iterable[int]) -> None:
        """Count ``pids`` too (before ``start``)."""
        self._others += list(pids)

    def start(self) -> None:
        self._own0, self._others0 = _self_seconds(), _threads_seconds(self._others)
        self._host0, self._t0 = _host_seconds(), time.monotonic()

    def stop(self, extra: float = 0.0) -> CpuWindow:
        wall = time.monotonic() - self._t0
        host = _host_seconds() - self._host0
        own = _self_seconds() - self._own0 + _threads_seconds(self._others) - self._others0
        return CpuWindow(own + extra, host, wall)
