"""``netstorm reproduce [--quick] [--out DIR]``: the paper's evaluation (Figs. 13-20) on this host, and a
report of each figure beside the paper's own numbers."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

NAME = "reproduce"
HELP = "run the paper's evaluation (Figs. 13-20) in emulation and write a report beside the paper's numbers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="the quick profile: fewer iterations and sweep points, within an hour on a 2-core host "
                             "(default: the full profile, a few hours)")
    parser.add_argument("--out-dir", dest="out", metavar="DIR", default="reproduce-results",
                        help="result JSON, logs, plots and README.md go here; runs whose JSON is already here are "
                             "skipped, so a second call resumes (default ./reproduce-results)")
    # --out names a file on every other command; the directory's former flag still works
    parser.add_argument("--out", dest="out", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--only", metavar="FIGS",
                        help="comma-separated figures to run (13,14,15,16,17,18,19a,19b,20); the report still "
                             "covers every figure with the results there are")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the runs, their commands and the estimated time, and run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the report from the results already in DIR")
    parser.add_argument("--bundle", action="store_true",
                        help="with --report-only: also fold DIR's run files into DIR/runs.json (how a committed "
                             "evaluation is kept: one file for all its runs)")


def run(args: argparse.Namespace) -> int:
    from netstorm.emulation import figures, reproduce

    profile = figures.QUICK if args.quick else figures.FULL
    out = Path(args.out)
    all_runs = figures.runs(profile)
    chosen = all_runs
    if args.only:
        wanted = {f.strip() for f in args.only.split(",") if f.strip()}
        unknown = wanted - set(figures.FIGURES)
        if unknown:
            print(f"netstorm reproduce: unknown figure(s) {', '.join(sorted(unknown))}; known: "
                  f"{', '.join(figures.FIGURES)}", file=sys.stderr)
            return 2
        chosen = [r for r in all_runs if wanted & set(r.figures)]
    if args.dry_run:
        for r in chosen:
            usable, dropped = reproduce.available(r)
            note = f"  (not in this build: {', '.join(dropped)})" if dropped else ""
            print(f"Fig. {','.join(r.figures)}: {usable.command(f'{args.out}/{r.name}.json')}{note}")
        print(f"{len(chosen)} runs, about {reproduce.clock_text(reproduce.estimate_s(chosen))} on this host "
              "(from the predicted synchronization times; runs already in --out are skipped)")
        return 0
    if not args.report_only:
        if os.geteuid() != 0:
            print("netstorm reproduce: needs root (network namespaces, veth, tc); run it as root", file=sys.stderr)
            return 2
        outcome = reproduce.execute(profile, chosen, out, out_label=args.out)
        for name, why in outcome.failed.items():
            print(f"netstorm reproduce: run {name}: {why}", file=sys.stderr)
    if args.bundle:
        print(f"runs folded into {reproduce.bundle(out, profile.name)}", file=sys.stderr)
    path = write_report(profile, out)
    print(f"report written to {path}", file=sys.stderr)
    return 0


def write_report(profile: Any, out: Path, *, draw: bool = True) -> Path:
    """``out/README.md`` and each figure's chart ``out/fig<N>.png`` from the results in ``out``; with
    ``draw`` false the same text without drawing the charts (matplotlib is most of the time)."""
    from netstorm.emulation import figures, markdown, plots, reproduce

    found = {}
    for r in figures.runs(profile):
        result = reproduce.load_run(out, r.name)
        if result is not None:
            found[r.name] = result
    reports = [build(found, profile) for build in figures.FIGURES.values()]
    charts: dict[str, str] = {}
    out.mkdir(parents=True, exist_ok=True)
    for report in reports:
        if report.chart is None:
            continue
        drawn = (plots.figure_chart(report.chart, out / f"fig{report.figure}.png") is not None if draw
                 else plots.chart_has_data(report.chart))
        if drawn:
            charts[report.figure] = f"fig{report.figure}.png"
    text = markdown.reproduce_readme(profile, reports, found, report_notes(profile, found), charts)
    path = out / "README.md"
    path.write_text(text)
    return path


def report_notes(profile: Any, found: dict[str, Any]) -> list[str]:
    """What the report lacks, from the results themselves: runs not there, systems a run did not have."""
    from netstorm.emulation import figures
    from netstorm.emulation.cpu import CPU_BOUND_PCT, STEAL_WARN_PCT

    notes: list[str] = []
    missing = [r.name for r in figures.runs(profile) if r.name not in found]
    if missing:
        notes.append("runs without a result here (not run yet, or failed): " + ", ".join(f"`{m}`" for m in missing))
    rows = [(name, s) for name, result in found.items() for s in result["systems"].values()]
    bound = [name for name, s in rows if s.get("cpu", {}).get("mean_pct", 0.0) >= CPU_BOUND_PCT]
    if bound:
        notes.append(f"{len(bound)} of {len(rows)} system runs (in {len(set(bound))} of {len(found)} runs) had the "
                     f"host's CPU at {CPU_BOUND_PCT:.0f} % or more: their times are partly CPU, not network, "
                     "results (each run's table has the CPU % per system; its notes say which)")
    stolen = [name for name, s in rows if s.get("cpu", {}).get("steal_pct", 0.0) >= STEAL_WARN_PCT]
    if stolen:
        notes.append(f"{len(stolen)} of {len(rows)} system runs had the hypervisor take {STEAL_WARN_PCT:.0f} % or "
                     "more of the CPU (steal)")
    for r in figures.runs(profile):
        result = found.get(r.name)
        if result is None:
            continue
        absent = [s for s in r.systems if s not in result["systems"]]
        if absent:
            notes.append(f"run `{r.name}` ran without {', '.join(f'`{s}`' for s in absent)} (not in the build "
                         "that made it); the figures leave those cells empty")
    return notes
