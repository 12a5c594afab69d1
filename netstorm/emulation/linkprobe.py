"""Bulk probes of an emulated WAN's links, run from the DCs' namespaces (``netstorm.bulkprobe``).

``netstorm probe --emulate`` and ``emulate --probe-by emulator`` measure each link here, one at a time;
a job's own first probe round (``emulate --plan-scenario``) is measured by its nodes, and
``comparison`` sets either against the rate the emulator applied, the truth that emulation knows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection
from typing import Any

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.network import EmulatedNetwork
from netstorm.scenario import Rates

PORT = 9750
"""The sinks' port in every DC's namespace (free there: nothing else runs before the probe)."""


def probe_links(net: EmulatedNetwork, links: Collection[tuple[int, int]], nbytes: int, *,
                port: int = PORT, timeout: float = 60.0) -> Rates:
    """Each directed link of ``links`` measured by a bulk probe of ``nbytes``, one at a time (a DC's
    links do not share its probe), in the scenario's units (the emulator's rates divided by bw_scale)."""
    sinks = [net.spawn(dc, [sys.executable, "-m", "netstorm.bulkprobe", "sink", f"{net.node_address(dc)}:{port}"],
                       stdout=subprocess.PIPE)
             for dc in sorted({b for _, b in links})]
    try:
        for proc in sinks:  # each prints one line once it listens
            assert proc.stdout is not None
            if not proc.stdout.readline():
                raise EmulationError("a probe sink did not start in its namespace")
        measured: Rates = {}
        for src in sorted({a for a, _ in links}):  # one process per DC, its links one after the other
            dsts = sorted(b for a, b in links if a == src)
            sender = net.spawn(src, [sys.executable, "-m", "netstorm.bulkprobe", "send", str(nbytes),
                                     *(f"{net.node_address(dst)}:{port}" for dst in dsts), "--timeout", str(timeout)],
                               stdout=subprocess.PIPE)
            out, _ = sender.communicate(timeout=(timeout + 30) * len(dsts))
            answers: list[dict[str, Any]] = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
            for dst, answer in zip(dsts, answers + [{}] * (len(dsts) - len(answers)), strict=True):
                if "mbit" not in answer:
                    raise EmulationError(f"probe {src}->{dst}: {answer.get('error', 'no answer')}")
                measured[(src, dst)] = float(answer["mbit"]) / net.bw_scale
        return measured
    finally:
        for proc in sinks:
            proc.terminate()
            proc.wait(timeout=10)


def comparison(measured: Rates, applied: Rates) -> list[dict[str, Any]]:
    """One row per probed link: measured and applied Mbit/s and their ratio."""
    return [{"src": a, "dst": b, "measured_mbit": round(rate, 3), "applied_mbit": applied.get((a, b)),
             "ratio": round(rate / applied[(a, b)], 4) if applied.get((a, b)) else None}
            for (a, b), rate in sorted(measured.items())]
