"""``netstorm bench probe-first``: a job told no rates, its links probed before the first policy, against
the same job told the true rates.

Both runs emulate the same WAN (``--scenario``, its rates applied); the ``probed`` run's scheduler is
given ``--told`` (the same DCs and links, no rates: ``internet2-9-bare``), and the ``true`` run's
scheduler the scenario itself. In the probed run the scheduler has its nodes bulk-probe every link
from inside their namespaces before the first policy, as on real hosts (``netstorm emulate
--plan-scenario``; ``--probe-by emulator`` has the emulator probe instead and tell the scheduler the
rates). The pairs alternate their order (probed then true, true then probed, ...) so a steady drift
of the host's load falls on both kinds alike.
The claim: the measured rates are within a few % of the applied ones, the first policy is planned
from them, and the mean iteration time (iterations 2..N, the first carries the connections' start) is
within 10 % of the true-rates run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from netstorm.provenance import write_result

HELP = "a job told no rates (links probed before the first policy) against one told the true rates"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="internet2-9", help="the emulated WAN (default internet2-9)")
    parser.add_argument("--told", default="internet2-9-bare", help="what the probed run's scheduler is told")
    parser.add_argument("--system", default="netstorm", metavar="NAMES",
                        help="comma-separated systems of both runs (default netstorm)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--model", default="2.5M")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--probe-by", choices=("scheduler", "emulator"), default="scheduler",
                        help="who probes in the probed runs: the scheduler through its nodes (default) or the "
                             "emulator")
    parser.add_argument("--fold", nargs="+", metavar="RESULT.json",
                        help="fold results of `netstorm emulate` already made (those with a probe record are the "
                             "probed runs) instead of running")
    parser.add_argument("--keep", metavar="DIR", help="keep each run's `netstorm emulate` result in DIR (to fold "
                                                     "again, or to compare their policies)")
    parser.add_argument("--out", metavar="FILE", help="write the result JSON to FILE")


def _mean_s(result: dict[str, Any], system: str) -> float:
    times = result["systems"][system]["iteration_s"]
    return statistics.fmean(times[1:] if len(times) > 1 else times)


def probe_record(result: dict[str, Any], system: str) -> dict[str, Any]:
    """A probed run's probe: the run's (what it was told, who probed) with the system's own (what its
    scheduler measured) over it; results from before ``--probe-by`` were the emulator's."""
    return {"by": "emulator", **result["probe"], **result["systems"][system].get("probe", {})}


def plan_at_true_rates(result: dict[str, Any], system: str, probe: dict[str, Any]) -> float:
    """The first policy's pace where the host is not the limit: the busiest link's seconds, at the
    applied rates, of the plan made from the probed rates over that of the plan made from the applied
    ones (1.0: the probe cost the plan nothing), planned as the run's scheduler planned."""
    from netstorm.planning.plan import plan
    from netstorm.planning.predict import busiest_link_s
    from netstorm.scenario import load

    truth = load(result["scenario"]).rates()
    measured = {**truth, **{(r["src"], r["dst"]): r["measured_mbit"] for r in probe["links"]}}
    switches = result["systems"][system]["switches"]
    topology = result["systems"][system]["topology"]

    def planned(rates: dict[tuple[int, int], float]) -> Any:
        return plan(rates, topology=topology, aux=False, packing=switches["tree_packing"],
                    num_roots=switches["num_root_servers"])

    return busiest_link_s(planned(measured), truth) / busiest_link_s(planned(truth), truth)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 4), "max": round(max(values), 4),
            "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0}


def fold(results: list[dict[str, Any]], system: str) -> dict[str, Any]:
    """The claim's numbers from the runs: per repeat and their spread."""
    probed = [r for r in results if "probe" in r]
    true = [r for r in results if "probe" not in r]
    if not probed or not true:
        raise SystemExit("need at least one probed and one true-rates run")
    probes = [probe_record(r, system) for r in probed]
    if len({p["by"] for p in probes}) > 1:
        raise SystemExit("the probed runs were probed by different sides; fold them separately")
    if any(p["worst_relative_error"] is None for p in probes):
        raise SystemExit("a probed run measured no link (see its result's probe.failed)")
    p_means = [_mean_s(r, system) for r in probed]
    t_means = [_mean_s(r, system) for r in true]
    ratio = statistics.fmean(p_means) / statistics.fmean(t_means)
    first = [next(p for p in r["systems"][system]["policy_versions"]["policies"] if p["version"] == 0)["reason"]
             for r in probed]
    by = probes[0]["by"]
    return {
        "claim": "told no rates, the job probes every link before its first policy; its iterations take within 10 % "
                 "of a job told the true rates",
        "scenario": probed[0]["scenario"], "told": probed[0]["probe"]["plan_scenario"], "system": system,
        "model": probed[0]["model"], "iterations": probed[0]["iterations"],
        "probe_by": by,
        "probed_mean_iteration_s": [round(m, 4) for m in p_means],
        "true_mean_iteration_s": [round(m, 4) for m in t_means],
        "spread": {"probed_mean_iteration_s": _spread(p_means), "true_mean_iteration_s": _spread(t_means)},
        "probed_iteration_s": [r["systems"][system]["iteration_s"] for r in probed],
        "true_iteration_s": [r["systems"][system]["iteration_s"] for r in true],
        "limit_s": probed[0]["limit_s"],
        "true_over_limit": round(statistics.fmean(t_means) / probed[0]["limit_s"], 2),
        "note": "the pairs alternate which kind runs first; when true_over_limit is well above 1 the iterations "
                "are the host's (CPU), not the links', and the comparison says the probe costs no more than that; "
                "first_policy.busiest_link_at_true_rates_over_true_plan is the host-independent figure",
        "ratio_probed_over_true": round(ratio, 4), "within_10pct": abs(ratio - 1) <= 0.10,
        "first_policy": {"reasons": first,
                         "busiest_link_at_true_rates_over_true_plan": [
                             round(plan_at_true_rates(r, system, p), 4) for r, p in zip(probed, probes, strict=True)],
                         "planned_from": "the rates the scheduler's first probe round measured (its status' probed "
                                         "rows; the reason counts them)" if by == "scheduler" else
                                         "the plan scenario with the probed rates filled in (scheduler-scenario.toml)"},
        "probe": {"by": by, "seconds": [p["seconds"] for p in probes],
                  "worst_relative_error": [p["worst_relative_error"] for p in probes],
                  "failed": [p.get("failed", []) for p in probes],
                  "links": [p["links"] for p in probes], "probe_bytes": probes[0]["probe_bytes"],
                  "prior_mbit": probes[0]["prior_mbit"]},
        "cpu_mean_pct": {"probed": [r["systems"][system]["cpu"]["mean_pct"] for r in probed],
                         "true": [r["systems"][system]["cpu"]["mean_pct"] for r in true]},
        "load_average_at_end": {kind: [r.get("provenance", {}).get("host", {}).get("load_average") for r in runs]
                                for kind, runs in (("probed", probed), ("true", true))},
        "commands": [r.get("command") for r in results],
        "runs_commit": sorted({str(r.get("provenance", {}).get("commit")) for r in results}),
        "host": probed[0].get("host"),
    }


def run(args: argparse.Namespace) -> int:
    if args.fold:
        results = [json.loads(Path(p).read_text()) for p in args.fold]
    else:
        results = []
        with tempfile.TemporaryDirectory(prefix="netstorm-probe-first-") as scratch:
            if args.keep:
                scratch = args.keep
                Path(scratch).mkdir(parents=True, exist_ok=True)
            for repeat in range(args.repeats):
                for kind in ("probed", "true") if repeat % 2 == 0 else ("true", "probed"):
                    out = Path(scratch) / f"{kind}-{repeat}.json"
                    argv = [sys.executable, "-m", "netstorm.cli", "emulate", args.scenario, "--system", args.system,
                            "--iterations", str(args.iterations), "--model", args.model, "--out", str(out)]
                    if kind == "probed":
                        argv += ["--plan-scenario", args.told, "--probe-by", args.probe_by]
                    started = time.monotonic()
                    subprocess.run(argv, check=True, env=os.environ)
                    print(f"{kind} run {repeat + 1}/{args.repeats}: {time.monotonic() - started:.0f} s", flush=True)
                    results.append(json.loads(out.read_text()))
    system = args.system.split(",")[0]
    folded = fold(results, system)
    if args.out:
        folded = write_result(args.out, folded)
    print(f"probed {folded['probed_mean_iteration_s']} s vs true {folded['true_mean_iteration_s']} s per iteration: "
          f"ratio {folded['ratio_probed_over_true']:.3f} (within 10 %: {folded['within_10pct']}); probes within "
          f"{max(folded['probe']['worst_relative_error']):.1%} of the applied rates")
    return 0 if folded["within_10pct"] else 1
