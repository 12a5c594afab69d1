"""``netstorm report RESULT.json``: redraw an emulation result's summary table and plots (``--csv FILE``:
one row per system and iteration); ``--fold OUT RUN...``: fold repeats of one experiment into one file;
``--markdown DIR``: write DIR/README.md from every result in DIR (``results/README.md``)."""

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
    parser.add_argument("--csv", metavar="FILE",
                        help="write one row per run, system and iteration of the results to FILE ('-': stdout); "
                             "a benchmark result gives one row per run and path")
    parser.add_argument("--fold", metavar="OUT",
                        help="fold the result files given (repeats of one experiment, the first the "
                             "representative) into OUT, with the spread of their figures")
    parser.add_argument("--check", action="store_true",
                        help="with --markdown: exit 1 if DIR/README.md differs from what the results give")


def run(args: argparse.Namespace) -> int:
    from netstorm.emulation import compressed, plots, repeats, results

    if args.markdown:
        return _markdown(Path(args.markdown), args.check)
    if not args.result:
        print("netstorm report: give RESULT.json file(s) or --markdown DIR", file=sys.stderr)
        return 2
    if args.fold or args.csv:
        return _fold_or_csv(args)
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
        for line in repeats.spread_lines(result):
            print(line)
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


def _fold_or_csv(args: argparse.Namespace) -> int:
    from netstorm.emulation import repeats

    docs = []
    for name in args.result:
        try:
            docs.append((Path(name), json.loads(Path(name).read_text())))
        except (OSError, ValueError) as exc:
            print(f"netstorm report: cannot read {name}: {exc}", file=sys.stderr)
            return 1
    if args.fold:
        try:
            repeats.fold_files(Path(args.fold), [p for p, _ in docs])
        except ValueError as exc:
            print(f"netstorm report: {exc}", file=sys.stderr)
            return 1
        print(f"written {args.fold} ({len(docs)} runs)", file=sys.stderr)
    if args.csv:
        named = [(p.name, d) for p, d in docs]
        if args.csv == "-":
            repeats.write_csv(sys.stdout, named)
        else:
            Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
            with open(args.csv, "w", newline="") as out:
                count = repeats.write_csv(out, named)
            print(f"written {args.csv} ({count} rows)", file=sys.stderr)
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
