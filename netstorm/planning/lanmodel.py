"""The tier inside a DC as the planners see it: an aggregation tree over the LAN and its predicted throughput.

See docs/ARCHITECTURE.md, *Planning the tier inside a DC*."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from netstorm.errors import PolicyError
from netstorm.lan_scenario import LanSpec, LanWorker

GATEWAY = "gateway"
"""The gateway's id in a plan's tree (it is the root)."""

PRECISION_SCALE: dict[str, float] = {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.25}
"""Bytes of a gradient at each precision, relative to fp32."""

Node = int | str
"""A worker's index, a rack's ToR aggregator (``tor_id``) or ``GATEWAY``."""


def tor_id(rack: int) -> str:
    """The id of rack ``rack``'s ToR aggregator in a plan's tree."""
    return f"rack{rack}"


def rack_of_tor(node: Node) -> int | None:
    """The rack a ToR aggregator id stands for (None for a worker or the gateway)."""
    if isinstance(node, str) and node.startswith("rack"):
        return int(node[4:])
    return None


def merge(precisions: Iterable[str]) -> str:
    """The lane an aggregate of these precisions travels in: one precision stays; fp16 with bf16 needs
    fp32; otherwise the widest (int8 with fp16 is fp16)."""
    kinds = set(precisions)
    if not kinds:
        raise PolicyError("an aggregate of no gradients")
    if len(kinds) == 1:
        return kinds.pop()
    if {"fp16", "bf16"} <= kinds or "fp32" in kinds:
        return "fp32"
    return "fp16" if "fp16" in kinds else "bf16"


@dataclass(frozen=True)
class Prediction:
    gbit: float
    """Gradient bits the workers push per second (Gbit/s): Σ β_w / T."""
    seconds_per_gbit: float
    """T for a gradient of 1 Gbit at fp32."""
    bottleneck: str
    """The resource that sets T."""
    rates: dict[int, float]
    """Worker -> its sending rate (Gbit/s)."""

    def sync_s(self, gradient_bytes: float) -> float:
        """Predicted synchronization time of a gradient of this many fp32 bytes."""
        return self.seconds_per_gbit * gradient_bytes * 8 / 1e9


@dataclass(frozen=True)
class DcPlan:
    """A planner's answer for one DC: the tree (child -> parent), aggregators, rates, prediction."""

    planner: str
    parent: Mapping[Node, Node]
    prediction: Prediction
    notes: tuple[str, ...] = ()
    """How the planner degraded on this DC (no racks, no solver in time...), for people."""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """Planner-specific facts (EINA's solver status and shares, ALEPH's rounds...), JSON-able."""
    fallback: str = ""
    """The tree used instead of the planner's ("flat") when its own was predicted slower; the reason is
    the last note. Empty: the planner's own tree."""

    @property
    def aggregators(self) -> list[Node]:
        """Every node other than the gateway that some worker or aggregator sends to, sorted."""
        return sorted({p for p in self.parent.values() if p != GATEWAY}, key=_order)

    @property
    def assignment(self) -> dict[int, Node | None]:
        """Worker -> the aggregator it sends to (None: straight to the gateway)."""
        return {w: (None if p == GATEWAY else p) for w, p in sorted(self.parent.items(), key=lambda kv: _order(kv[0]))
                if isinstance(w, int)}

    @property
    def rates(self) -> dict[int, float]:
        return dict(self.prediction.rates)

    def runtime(self) -> dict[str, Any]:
        """The structure the runtime takes: aggregators, assignment and rates (worker ids as ints)."""
        return {"aggregators": self.aggregators, "assignment": self.assignment, "rates": self.rates}

    def to_json(self) -> dict[str, Any]:
        return {"aggregators": self.aggregators,
                "assignment": {str(w): a for w, a in self.assignment.items()},
                "rates": {str(w): round(r, 6) for w, r in self.rates.items()},
                "tree": {str(c): p for c, p in sorted(self.parent.items(), key=lambda kv: _order(kv[0]))},
                "predicted_gbit": round(self.prediction.gbit, 6),
                "bottleneck": self.prediction.bottleneck,
                "notes": list(self.notes),
                **({"fallback": self.fallback} if self.fallback else {}),
                **({"detail": dict(self.detail)} if self.detail else {})}


def _order(node: Node) -> tuple[int, int]:
    if isinstance(node, int):
        return (0, node)
    rack = rack_of_tor(node)
    return (1, rack) if rack is not None else (2, 0)


def two_level(plan: DcPlan) -> tuple[dict[int, list[int]], list[int]]:
    """The data plane's two-level configuration: ``{aggregator worker: [member workers]}`` and the
    workers that send straight to the gateway (aggregators included: they forward to it).

    Only trees the data plane can run convert: aggregators are workers and sit right under the gateway.
    """
    clusters: dict[int, list[int]] = {}
    direct: list[int] = []
    for child, parent in sorted(plan.parent.items(), key=lambda kv: _order(kv[0])):
        if not isinstance(child, int):
            raise PolicyError(f"{plan.planner}: {child} aggregates in the plan; the data plane has no ToR "
                              "aggregators (plan the DC without them)")
        if parent == GATEWAY:
            direct.append(child)
        elif isinstance(parent, int):
            if plan.parent.get(parent) != GATEWAY:
                raise PolicyError(f"{plan.planner}: worker {child} -> {parent} -> {plan.parent.get(parent)} is "
                                  "deeper than the data plane's two levels")
            clusters.setdefault(parent, []).append(child)
        else:
            raise PolicyError(f"{plan.planner}: worker {child} sends to {parent}; the data plane has no ToR "
                              "aggregators")
    return {a: sorted(m) for a, m in sorted(clusters.items())}, direct


def from_two_level(clusters: Mapping[int, Iterable[int]], workers: Iterable[int]) -> dict[Node, Node]:
    """A tree from the data plane's configuration (every worker not a member sends to the gateway)."""
    parent: dict[Node, Node] = {w: GATEWAY for w in workers}
    for agg, members in clusters.items():
        for m in members:
            parent[m] = agg
    return parent


def check_tree(lan: LanSpec, parent: Mapping[Node, Node]) -> None:
    """Every worker is in the tree, every path reaches the gateway, ToRs exist and have a worker below."""
    workers = {w.index for w in lan.workers}
    racks = {r.id for r in lan.racks}
    missing = workers - {c for c in parent if isinstance(c, int)}
    if missing:
        raise PolicyError(f"workers {sorted(missing)} are not in the plan")
    for child, up in parent.items():
        for node in (child, up):
            if isinstance(node, int) and node not in workers:
                raise PolicyError(f"node {node} is not a worker of this DC")
            if isinstance(node, str) and node != GATEWAY and rack_of_tor(node) not in racks:
                raise PolicyError(f"{node} is not a rack of this DC")
        if child == GATEWAY:
            raise PolicyError("the gateway has no parent")
        seen = {child}
        node = up
        while node != GATEWAY:
            if node in seen or node not in parent:
                raise PolicyError(f"{child} does not reach the gateway (cycle or dangling {node})")
            seen.add(node)
            node = parent[node]


def subtree_lanes(lan: LanSpec, parent: Mapping[Node, Node]) -> dict[Node, str]:
    """Node -> the lane of the aggregate it sends up (the merged precision of the workers below it)."""
    below: dict[Node, set[str]] = {}
    by_index = {w.index: w for w in lan.workers}
    for w in by_index.values():
        node: Node = w.index
        while node != GATEWAY:
            below.setdefault(node, set()).add(w.precision)
            node = parent[node]
    return {n: merge(p) for n, p in below.items()}


def _rack(node: Node, by_index: Mapping[int, LanWorker]) -> int | None:
    if isinstance(node, int):
        return by_index[node].rack
    return rack_of_tor(node)


def predict(lan: LanSpec, parent: Mapping[Node, Node]) -> Prediction:
    """The fluid model's prediction for the tree ``parent`` (see the module docstring)."""
    check_tree(lan, parent)
    by_index = {w.index: w for w in lan.workers}
    lanes = subtree_lanes(lan, parent)
    size = {n: PRECISION_SCALE[p] for n, p in lanes.items()}
    children: dict[Node, list[Node]] = {}
    for c, p in parent.items():
        if c in size:  # a ToR with no worker below carries nothing
            children.setdefault(p, []).append(c)
    seconds: list[tuple[float, str]] = []
    for w in lan.workers:
        load = size[w.index] + sum(size[c] for c in children.get(w.index, ()))
        seconds.append((load / min(w.up_gbit, w.down_gbit), f"worker {w.index} port"))
        kids = children.get(w.index, ())
        if kids and w.agg_gbit is not None:
            summed = PRECISION_SCALE[w.precision] + sum(size[c] for c in kids)
            seconds.append((summed / w.agg_gbit, f"worker {w.index} aggregation"))
    for rack in lan.racks:
        tor = tor_id(rack.id)
        per_lane: dict[str, float] = {}
        for c in children.get(tor, ()):
            per_lane[lanes[c]] = per_lane.get(lanes[c], 0.0) + size[c]
        for lane, bits in per_lane.items():
            cap = rack.capacity(lane)
            if cap <= 0:
                raise PolicyError(f"{tor} cannot aggregate {lane} lanes")
            seconds.append((bits / cap, f"{tor} {lane} aggregation"))
        if per_lane and not rack.precision_gbit:
            seconds.append((sum(per_lane.values()) / rack.aggregator_gbit, f"{tor} aggregation"))
        crossing = sum(size[c] for c, p in parent.items() if c in size
                       and (_rack(c, by_index) == rack.id) != (_rack(p, by_index) == rack.id
                                                               if p != GATEWAY else False))
        if crossing:
            seconds.append((crossing / rack.uplink_gbit, f"{tor} uplink"))
    into_gateway = sum(size[c] for c in children.get(GATEWAY, ()))
    seconds.append((into_gateway / lan.gateway_gbit, "gateway port"))
    t, where = max(seconds)
    if not (t > 0 and math.isfinite(t)):
        raise PolicyError(f"no finite synchronization time ({t})")
    rates = {w.index: PRECISION_SCALE[w.precision] / t for w in lan.workers}
    return Prediction(sum(rates.values()), t, where, rates)


def flat(lan: LanSpec) -> dict[Node, Node]:
    """Today's tier: every worker sends to the gateway."""
    return {w.index: GATEWAY for w in lan.workers}


def ring_allreduce(lan: LanSpec) -> Prediction:
    """A ring all-reduce among the workers (gloo, Horovod) with the gateway as one more member (it
    contributes nothing and ends with the sum the WAN tier needs): each of the n + 1 members moves
    2n/(n+1) of the gradient each way, so the slowest port sets the pace; a ring visiting racks in turn
    crosses each rack's uplink with the same amount. The ring sums in one lane, the merged precision of
    all workers. Without a gateway to feed (n members) this is ALEPH's 2(n-1)/n."""
    n = len(lan.workers)
    scale = PRECISION_SCALE[merge(w.precision for w in lan.workers)]
    per = 2 * n / (n + 1) * scale
    seconds = [(per / min(w.up_gbit, w.down_gbit), f"worker {w.index} port") for w in lan.workers]
    seconds.append((per / lan.gateway_gbit, "gateway port"))
    if lan.racks:
        seconds += [(per / r.uplink_gbit, f"{tor_id(r.id)} uplink") for r in lan.racks
                    if any(w.rack == r.id for w in lan.workers)]
    t, where = max(seconds)
    rates = {w.index: PRECISION_SCALE[w.precision] / t for w in lan.workers}
    return Prediction(sum(rates.values()), t, where, rates)


def make_plan(planner: str, lan: LanSpec, parent: Mapping[Node, Node], notes: Iterable[str] = (),
              detail: Mapping[str, Any] | None = None) -> DcPlan:
    """A DcPlan with the shared model's prediction for ``parent``; ToRs no worker sits below are dropped."""
    kept = {c: p for c, p in parent.items()}
    lanes = subtree_lanes(lan, kept)
    kept = {c: p for c, p in kept.items() if c in lanes}
    return DcPlan(planner, kept, predict(lan, kept), tuple(notes), dict(detail or {}))
