"""``edge_mode=auto``: which LAN path serves a gateway, decided from measurements of the paths on a LAN
like its own (a short calibration at start: ``netstorm.bench.edge.calibrate``, which the emulator runs
once per distinct LAN before the job and ``netstorm bench edge`` reports as ``auto_pick``).

Which path is fastest is not a constant: XDP pays the kernel's per-datagram work (segmentation at the
bridge, one program run per MTU-sized datagram), TCP moves 64 KB segments through veth and the bridge
but sums in userspace, and the userspace fallback pays both the datagrams and the Python. The MTU, the
number of workers, shaping and the host's load move the balance, so the decision is a measurement, and
this module is the rule applied to it, as a pure function:

1. a path is a candidate if it may serve this LAN (``candidates``: TCP is one level and dense, so a
   two-level deployment or a compressed job leaves it out) and it ran and returned exact sums;
2. the candidate with the highest ``wall_gbit`` wins, except that a candidate within ``TIE`` of it that
   spent less host CPU per GB is taken instead (the calibration is short and the host shared: a
   difference that small is noise, and the CPU is what the rest of the host keeps);
3. when no candidate was measured the gateway falls back as ``auto`` always did: XDP where it loads,
   else the userspace aggregator (``FALLBACK`` names the latter, the one that always loads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

PATHS = ("xdp", "userspace", "tcp")
FALLBACK = "userspace"
TIE = 0.05
"""Relative wall_gbit difference below which two paths count as equally fast."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One path's calibration: None ``wall_gbit`` when it could not run (``error`` says why)."""

    wall_gbit: float | None
    exact: bool = True
    host_cpu_seconds_per_gb: float | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Pick:
    path: str
    reason: str


def candidates(*, clustered: bool = False, compressed: bool = False) -> tuple[str, ...]:
    """The paths that can serve a LAN: all three, without TCP for a two-level deployment or a compressed
    job (the TCP path is one level and carries dense gradients)."""
    return tuple(p for p in PATHS if p != "tcp" or not (clustered or compressed))


def pick(measured: Mapping[str, Measured], allowed: tuple[str, ...] = PATHS) -> Pick:
    """The path ``edge_mode=auto`` takes under the measured conditions (module docstring)."""
    valid = {p: m for p, m in measured.items()
             if p in allowed and m.exact and m.wall_gbit is not None and math.isfinite(m.wall_gbit) and m.wall_gbit > 0}
    if not valid:
        return Pick(FALLBACK, "no path measured exactly: " + (", ".join(
            f"{p} {m.error or 'inexact'}" for p, m in sorted(measured.items())) or "nothing measured"))
    fastest = max(valid, key=lambda p: (valid[p].wall_gbit, -PATHS.index(p)))
    top = valid[fastest].wall_gbit
    assert top is not None

    def cpu(p: str) -> float:
        value = valid[p].host_cpu_seconds_per_gb
        return value if value is not None and math.isfinite(value) else math.inf

    close = [p for p, m in valid.items() if m.wall_gbit is not None and m.wall_gbit >= top * (1 - TIE)]
    chosen = min(close, key=lambda p: (cpu(p), PATHS.index(p)))
    rates = ", ".join(f"{p} {m.wall_gbit:.3g}" for p, m in sorted(valid.items()))
    if chosen != fastest:
        return Pick(chosen, f"{chosen} within {TIE:.0%} of {fastest} in wall Gbit/s ({rates}) with less host "
                            f"CPU per GB ({cpu(chosen):.3g} against {cpu(fastest):.3g})")
    return Pick(chosen, f"fastest in wall Gbit/s ({rates})")
