"""``netstorm bench probe-first``: a job told no rates, its links probed before the first policy, against
the same job told the true rates.

Both runs emulate the same WAN (``--scenario``, its rates applied); the ``probed`` run's scheduler is
given ``--told`` (the same DCs and links, no rates: ``internet2-9-bare``), whose links the emulator
probes from the DCs before the first policy (``netstorm emulate --plan-scenario``), and the ``true``
run's scheduler the scenario itself. The runs alternate (probed, true, probed, ...) so a drift of
the host's load falls on both. The claim: the measured rates are within a few % of the applied ones,
the first policy is planned from them, and the mean iteration time (iterations 2..N, the first
carries the connections' start) is within 10 % of the true-rates run's.
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
    parser.add_argument("--fold", nargs="+", metavar="RESULT.json",
                        help="fold results of `netstorm emulate` already made (those with a probe record are the "
                             "probed runs) instead of running")
    parser.add_argument("--out", metavar="FILE", help="write the result JSON to FILE")


def _mean_s(result: dict[str, Any], system: str) -> float:
    times = result["systems"][system]["iteration_s"]
    return statistics.fmean(times[1:] if len(times) > 1 else times)


def fold(results: list[dict[str, Any]], system: str) -> dict[str, Any]:
    """The claim's numbers from the runs: per repeat and their spread."""
    probed = [r for r in results if "probe" in r]
    true = [r for r in results if "probe" not in r]
    if not probed or not true:
        raise SystemExit("need at least one probed and one true-rates run")
    p_means = [_mean_s(r, system) for r in probed]
    t_means = [_mean_s(r, system) for r in true]
    ratio = statistics.fmean(p_means) / statistics.fmean(t_means)
    first = [next(p for p in r["systems"][system]["policy_versions"]["policies"] if p["version"] == 0)["reason"]
             for r in probed]
    return {
        "claim": "told no rates, the job probes every link before its first policy; its iterations take within 10 % "
                 "of a job told the true rates",
        "scenario": probed[0]["scenario"], "told": probed[0]["probe"]["plan_scenario"], "system": system,
        "model": probed[0]["model"], "iterations": probed[0]["iterations"],
        "probed_mean_iteration_s": [round(m, 4) for m in p_means],
        "true_mean_iteration_s": [round(m, 4) for m in t_means],
        "probed_iteration_s": [r["systems"][system]["iteration_s"] for r in probed],
        "true_iteration_s": [r["systems"][system]["iteration_s"] for r in true],
        "limit_s": probed[0]["limit_s"],
        "true_over_limit": round(statistics.fmean(t_means) / probed[0]["limit_s"], 2),
        "note": "the probed runs ran first in each pair; when true_over_limit is well above 1 the iterations are "
                "the host's (CPU), not the links', and the comparison says the probe costs no more than that",
        "ratio_probed_over_true": round(ratio, 4), "within_10pct": abs(ratio - 1) <= 0.10,
        "first_policy": {"reasons": first,
                         "planned_from": "the plan scenario with the probed rates filled in (scheduler-scenario.toml)"},
        "probe": {"seconds": [r["probe"]["seconds"] for r in probed],
                  "worst_relative_error": [r["probe"]["worst_relative_error"] for r in probed],
                  "links": probed[0]["probe"]["links"], "probe_bytes": probed[0]["probe"]["probe_bytes"],
                  "prior_mbit": probed[0]["probe"]["prior_mbit"]},
        "commands": [r.get("command") for r in results],
        "host": probed[0].get("host"),
    }


def run(args: argparse.Namespace) -> int:
    if args.fold:
        results = [json.loads(Path(p).read_text()) for p in args.fold]
    else:
        results = []
        with tempfile.TemporaryDirectory(prefix="netstorm-probe-first-") as scratch:
            for repeat in range(args.repeats):
                for kind in ("probed", "true"):
                    out = Path(scratch) / f"{kind}-{repeat}.json"
                    argv = [sys.executable, "-m", "netstorm.cli", "emulate", args.scenario, "--system", args.system,
                            "--iterations", str(args.iterations), "--model", args.model, "--out", str(out)]
                    if kind == "probed":
                        argv += ["--plan-scenario", args.told]
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
