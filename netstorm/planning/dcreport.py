"""What ``netstorm plan SCENARIO --dc N`` prints: one DC's plan beside every planner and baseline."""

from __future__ import annotations

from typing import Any

from netstorm.dcplanners import PLANNERS
from netstorm.errors import PolicyError
from netstorm.planning.dcplan import Options, baselines, plan_dc
from netstorm.planning.lanmodel import two_level
from netstorm.scenario import Scenario


def report(scenario: Scenario, dc: int, planner: str, options: Options) -> dict[str, Any]:
    """The chosen planner's plan of DC ``dc`` (JSON-able), every other planner's and every baseline's
    predicted throughput, and the data plane's two-level form when the plan has one."""
    try:
        node = scenario.node(dc)
    except KeyError:
        raise PolicyError(f"{scenario.name}: no DC {dc} (DCs: {', '.join(map(str, scenario.node_ids))})") from None
    if node.lan is None:
        raise PolicyError(f"{scenario.name}: DC {dc} ({node.name}) has no described LAN ([node.lan]); "
                          "the tier inside a DC is planned only from one")
    lan = node.lan
    chosen = plan_dc(lan, planner, options)
    others = {p: (chosen if p == planner else plan_dc(lan, p, options)) for p in PLANNERS}
    try:
        clusters, direct = two_level(chosen)
        runtime: dict[str, Any] = {"clusters": {str(a): m for a, m in clusters.items()}, "direct": direct}
    except PolicyError as exc:
        runtime = {"error": str(exc)}
    return {"source": scenario.name, "dc": dc, "name": node.name, "planner": planner, "workers": len(lan.workers),
            "racks": len(lan.racks), "tor": options.tor, **chosen.to_json(),
            "baselines": {k: round(v.gbit, 6) for k, v in baselines(lan, options).items()},
            "planners": {p: round(plan.prediction.gbit, 6) for p, plan in others.items()},
            "planner_notes": {p: list(plan.notes) for p, plan in others.items() if plan.notes},
            "runtime": runtime}


def text(r: dict[str, Any]) -> str:
    lines = [f"source {r['source']}, DC {r['dc']} ({r['name']}): {r['workers']} workers, {r['racks']} racks"
             f"{'' if r['tor'] else ' (workers only aggregate)'}",
             f"planner {r['planner']}: predicted {r['predicted_gbit']:.3f} Gbit/s (bottleneck {r['bottleneck']})"
             + (f", the {r['fallback']} tree: its own was predicted slower" if r.get("fallback") else ""),
             f"  aggregators: {', '.join(map(str, r['aggregators'])) or '(none)'}"]
    for worker, agg in r["assignment"].items():
        target = "gateway" if agg is None else agg
        lines.append(f"  worker {worker:>3} -> {target!s:<8} {r['rates'][worker]:8.3f} Gbit/s")
    deeper = {c: p for c, p in r["tree"].items() if not c.isdigit()}
    if deeper:
        lines.append("  aggregators above workers: " + ", ".join(f"{c} -> {p}" for c, p in deeper.items()))
    for note in r["notes"]:
        lines.append(f"  note: {note}")
    lines.append("predicted aggregation throughput (Gbit/s of gradients pushed):")
    for p, gbit in r["planners"].items():
        lines.append(f"  {p:<31} {gbit:9.3f}{'  <- chosen' if p == r['planner'] else ''}")
    for b, gbit in r["baselines"].items():
        lines.append(f"  {b + ' (baseline)':<31} {gbit:9.3f}")
    if "error" in r["runtime"]:
        lines.append(f"data plane: cannot run this plan: {r['runtime']['error']}")
    else:
        clusters = r["runtime"]["clusters"]
        lines.append("data plane (two levels): " + (", ".join(f"{a}: {m}" for a, m in clusters.items()) or "flat")
                     + f"; to the gateway: {r['runtime']['direct']}")
    return "\n".join(lines)
