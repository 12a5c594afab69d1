"""Who contributes to every sum in an emulated run: each DC's own trainer and each LAN worker (no I/O).

A DC's trainer keeps the DC's id; LAN worker i of DC d gets the next id after the highest DC id, counted
over DCs in ascending order, so every contributor's synthetic gradient is distinct and every one of them
can compute the exact expected sum from ``count`` and ``id_sum``. The gateway sums its LAN workers in
fixed point; ``edge_scale`` picks the largest scale (up to the gateway's default) whose int32 lanes hold
that sum, so integer gradients stay exact and never overflow.
"""

from __future__ import annotations

import dataclasses

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.topology import Plan
from netstorm.trainers.synthetic import sum_bound

DEFAULT_EDGE_SCALE = 16
"""The gateway's default fixed-point scale (``netstorm node --edge-scale``)."""
LANE_BITS = 31
"""Magnitude bits of an int32 lane."""


@dataclasses.dataclass(frozen=True)
class Contributor:
    label: str
    """``"3"`` for DC 3's own trainer, ``"3w0"`` for LAN worker 0 behind DC 3's gateway."""
    dc: int
    worker: int | None
    id: int


def contributors(plan: Plan) -> list[Contributor]:
    """Every DC's trainer, then every LAN worker, with distinct gradient ids."""
    out = [Contributor(str(dc), dc, None, dc) for dc in plan.node_ids]
    next_id = max(plan.node_ids) + 1
    for dc in plan.node_ids:
        lan = plan.lans.get(dc)
        for i in range(lan.workers if lan else 0):
            out.append(Contributor(f"{dc}w{i}", dc, i, next_id))
            next_id += 1
    return out


def edge_scale(lan_ids: list[int], *, default: int = DEFAULT_EDGE_SCALE) -> int:
    """The largest fixed-point scale <= ``default`` at which the LAN sum of ``lan_ids`` fits an int32
    lane with one bit to spare."""
    bits = sum_bound(lan_ids).bit_length()
    scale = min(default, LANE_BITS - 1 - bits)
    if scale < 0:
        raise EmulationError(f"LAN workers {lan_ids}: their synthetic gradients' sum needs {bits} bits, "
                             f"more than an int32 lane holds")
    return scale
