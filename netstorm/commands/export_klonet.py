"""``netstorm export-klonet``: write a scenario as the topology JSON Klonet's API takes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "export-klonet"
HELP = "write a scenario as Klonet topology JSON (links with bw_kbit, delay_us, loss_rate)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario file or name (e.g. internet2-9)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--bw-scale", type=float, default=1.0, help="multiply every link rate (default 1)")


def run(args: argparse.Namespace) -> int:
    from netstorm.emulation.klonet import to_klonet
    from netstorm.scenario import load

    text = json.dumps(to_klonet(load(args.scenario), bw_scale=args.bw_scale), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
