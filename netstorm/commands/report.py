"""``netstorm report RESULT.json``: redraw an emulation result's summary table and plots;
``netstorm report --markdown DIR``: write DIR/README.md from every result in DIR (``results/README.md``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "report"
HELP = "print the summary table of an emulation result (JSON) and redraw its plots, or write a directory's README"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", nargs="*",
                        help="result JSON(s) written by netstorm emulate --out; with several runs of different "
                             "sizes, the scaling efficiency of each system too")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: beside the result)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.add_argument("--markdown", metavar="DIR",
                        help="write DIR/README.md from every emulation result JSON in DIR (tables, commands, links "
                             "to the plots there), as results/README.md is made; --check: compare instead")
    parser.add_argument("--check", action="store_true",
                        help="with --markdown: exit 1 if DIR/README.md differs from what the results give")


def run(args: argparse.Namespace) -> int:
    from netstorm.emulation import compressed, plots, results

    if args.markdown:
        return _markdown(Path(args.markdown), args.check)
    if not args.result:
        print("netstorm report: give RESULT.json file(s) or --markdown DIR", file=sys.stderr)
        return 2
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


def _markdown(directory: Path, check: bool) -> int:
    from netstorm.emulation import markdown

    if not directory.is_dir():
        print(f"netstorm report: {directory} is not a directory", file=sys.stderr)
        return 1
    text = markdown.results_readme(directory, label=str(directory).rstrip("/"))
    path = directory / "README.md"
    if check:
        if not path.exists() or path.read_text() != text:
            print(f"netstorm report: {path} is not what the results there give; run netstorm report --markdown "
                  f"{directory}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"written {path}", file=sys.stderr)
    return 0
