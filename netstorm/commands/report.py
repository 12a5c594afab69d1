"""``netstorm report RESULT.json``: redraw an emulation result's summary table and plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "report"
HELP = "print the summary table of an emulation result (JSON) and redraw its plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", nargs="+",
                        help="result JSON(s) written by netstorm emulate --out; with several runs of different "
                             "sizes, the scaling efficiency of each system too")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: beside the result)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")


def run(args: argparse.Namespace) -> int:
    from netstorm.emulation import compressed, plots, results

    loaded = []
    for name in args.result:
        path = Path(name)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"netstorm report: cannot read {path}: {exc}", file=sys.stderr)
            return 1
        if not isinstance(result, dict) or result.get("format") != results.FORMAT_VERSION or "systems" not in result:
            print(f"netstorm report: {path} is not a netstorm emulate result (format {results.FORMAT_VERSION})",
                  file=sys.stderr)
            return 1
        loaded.append((path, result))
    for i, (path, result) in enumerate(loaded):
        if i:
            print()
        print(results.summary(result))
        for line in compressed.summary_lines(result):  # rows of `emulate --compression`
            print(line)
        if not args.no_plots:
            for plot in plots.draw_all(result, Path(args.plots) if args.plots else path.parent, path.stem):
                print(f"plot: {plot}", file=sys.stderr)
    lines = results.scaling([r for _, r in loaded])
    if lines:
        print("\nscaling (iterations 2..N):")
        print("\n".join(lines))
    return 0
