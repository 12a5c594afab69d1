"""The planned LAN tier of an emulated run: which workers aggregate whom in each DC with a described LAN.

A DC whose LAN the scenario describes (or ``runner.resize_lans`` does, for ``--lan-workers N`` with a
``dc_planner``) runs its gateway with ``--edge-lan``, that description: the gateway announces the LAN,
the scheduler plans it with ``dc_planner`` and pushes the plan, and the gateway deploys it. The
emulator must start ``netstorm lan-aggregator`` on each aggregator worker's host before its workers say
HELLO, so it makes the same plan itself: the scheduler's planning core (``scheduler.lanplanning``) on the
same description with the same options, which is deterministic. The plan is recorded in the result file
(per DC: the planner, its aggregators and the assignment), so a run says which planner each DC ran.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from netstorm import config as config_mod
from netstorm import lanreport
from netstorm.config import Config
from netstorm.control import LanPlan
from netstorm.scenario import Scenario


def run_config(flags: list[str]) -> Config:
    """The configuration the run's scheduler and nodes get from ``flags`` (file, environment, flags)."""
    parser = argparse.ArgumentParser(add_help=False)
    config_mod.add_arguments(parser)
    args, _ = parser.parse_known_args(flags)
    return config_mod.from_args(args)


@dataclass(frozen=True)
class DcTier:
    dc: int
    plan: LanPlan

    @property
    def aggregators(self) -> list[int]:
        return [a for a, _ in self.plan.clusters]

    def record(self) -> dict[str, Any]:
        """The result file's entry: planner, aggregators, ``assignment`` (worker -> its aggregator, or None
        for straight to the gateway), the rates the plan allocates (each worker's pace with ``dc_pace_rates``)
        and the predicted aggregation throughput."""
        clusters, direct = self.plan.two_level()
        assignment: dict[str, int | None] = {str(w): None for w in direct}
        for head, members in clusters.items():
            assignment.update({str(m): head for m in members})
        return {"planner": self.plan.planner, "aggregators": self.aggregators,
                "assignment": dict(sorted(assignment.items(), key=lambda kv: int(kv[0]))),
                "rates": {str(w): round(r, 4) for w, r in self.plan.rates},
                "predicted_gbit": round(self.plan.predicted_gbit, 4), "notes": self.plan.notes}


def planned_tiers(scenario: Scenario, config: Config) -> dict[int, DcTier]:
    """Per DC with a described LAN, the plan its scheduler will push (``dc_planner``)."""
    from scheduler.lanplanning import LanPlanning  # the planners' solvers load only for a planned tier

    tiers: dict[int, DcTier] = {}
    for dc in scenario.nodes:
        if dc.lan is None or dc.lan_workers == 0:
            continue
        core = LanPlanning(config)
        core.report(lanreport.report_from_spec(dc.id, dc.lan))
        job = core.begin(dc.id)
        plan = core.finish(job, core.compute(job))
        if plan is None:
            raise ValueError(f"DC {dc.id}: the {config.dc_planner} plan of its LAN cannot run in the data plane")
        tiers[dc.id] = DcTier(dc.id, plan)
    return tiers


def comparison(runs: dict[str, dict[str, Any]], system: str = "netstorm") -> dict[str, Any]:
    """Per planner and DC, from result files of one scenario: the DC's iteration time (mean over iterations
    2..N of its slowest LAN worker's), its aggregation throughput (the gradient bits its LAN workers push
    per second of that time) and whether every sum was exact."""
    rows: dict[str, Any] = {}
    for planner, result in runs.items():
        run = result["systems"][system]
        model_bits = 8 * int(result["model"]["bytes"])
        per_dc: dict[str, Any] = {}
        for dc, tier in sorted(run.get("lan_tier", {}).items()):
            series = [s for label, s in run["per_lan_worker_iteration_s"].items() if label.startswith(f"{dc}w")]
            done = min((len(s) for s in series), default=0)
            slowest = [max(s[k] for s in series) for k in range(1, done)]
            mean_s = sum(slowest) / len(slowest) if slowest else None
            per_dc[dc] = {"workers": len(series), "aggregators": tier["aggregators"],
                          "iteration_s": round(mean_s, 4) if mean_s else None,
                          "aggregation_gbit": round(len(series) * model_bits / mean_s / 1e9, 4) if mean_s else None,
                          "predicted_gbit": tier["predicted_gbit"]}
        rows[planner] = {"dc_planner": result["features"].get("dc_planner"), "exact": run["exact"],
                         "iterations_completed": run["iterations_completed"], "iteration_s": run["iteration_s"],
                         "host_cpu": run.get("cpu"), "dcs": per_dc}
    return rows
