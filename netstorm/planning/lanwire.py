"""What a two-level LAN plan costs on our wire, as against what the planners' fluid model assumes.

The fluid model (``lanmodel``) lets an aggregate travel in the merged lane of the precisions below it (an
int8 cluster sends a quarter of an fp32 one) and carries results down the tree at the same size. Our data
plane does neither: an aggregator widens every lane to int32 fixed point and forwards int32 partial sums
(4 bytes a lane whatever its members sent), and the gateway multicasts each result once, in 32-bit lanes,
to every worker's downlink. Only the members' own pushes are narrow on the wire. This module counts a
plan that way, so a scenario can be checked for whether the model's gain of one plan over another is one
the data plane can show (a plan whose aggregators are fp32 workers, on downlinks wide enough for 32-bit
results, costs the same in both).

Per fp32 Gbit of gradient: a worker's uplink carries its push (β of its precision), or an aggregator's
int32 aggregate (1); its downlink the result (1) plus, for an aggregator, its members' pushes; the
gateway's port the pushes and aggregates that reach it in, and the result (1) out. The time is the
largest load / rate, as in the fluid model.
"""

from __future__ import annotations

from dataclasses import dataclass

from netstorm.lan_scenario import LanSpec
from netstorm.planning.lanmodel import PRECISION_SCALE, DcPlan, two_level

WIRE_LANE = 1.0
"""Bytes of a forwarded aggregate's or a result's lane, relative to fp32 (int32 fixed point)."""


@dataclass(frozen=True)
class WireCost:
    seconds_per_gbit: float
    """Time per fp32 Gbit of gradient on the wire."""
    bottleneck: str
    gbit: float
    """Gradient bits the workers push per second (the model's throughput measure), on the wire."""


def wire_cost(lan: LanSpec, plan: DcPlan) -> WireCost:
    """The plan's synchronization time counted as the data plane moves bytes (see the module docstring)."""
    clusters, direct = two_level(plan)
    beta = {w.index: PRECISION_SCALE[w.precision] for w in lan.workers}
    seconds: list[tuple[float, str]] = []
    for w in lan.workers:
        up = WIRE_LANE if w.index in clusters else beta[w.index]
        down = WIRE_LANE + sum(beta[m] for m in clusters.get(w.index, ()))
        seconds.append((up / w.up_gbit, f"worker {w.index} uplink"))
        seconds.append((down / w.down_gbit, f"worker {w.index} downlink"))
    into = sum(WIRE_LANE if d in clusters else beta[d] for d in direct)
    seconds.append((into / lan.gateway_gbit, "gateway in"))
    seconds.append((WIRE_LANE / lan.gateway_gbit, "gateway out (results)"))
    t, where = max(seconds)
    return WireCost(t, where, sum(beta.values()) / t)
