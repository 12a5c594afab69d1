"""``netstorm bench NAME``: benchmarks that print ratios against a baseline measured in the same run.

Each benchmark is a module ``netstorm.bench.<name>`` with ``HELP``, ``add_arguments`` and ``run``.
"""

from __future__ import annotations

import argparse
import importlib

NAME = "bench"
BENCHMARKS = {"policy": "policy", "packing": "packing", "loopback": "loopback", "edge": "edge", "codec": "codec",
              "dc-plan": "dcplan", "lan-rounds": "lan_rounds", "replan": "replan", "probe-first": "probefirst",
              "layout": "layout", "sizes": "sizes"}
"""Each benchmark's name on the command line -> its module in netstorm/bench/ (the help follows from it)."""
HELP = f"run a benchmark ({', '.join(BENCHMARKS)}): ratios against a baseline measured in the same run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(f"netstorm.bench.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"netstorm.bench.{module_name}":
                continue
            from netstorm.cli import needs_extra

            module = needs_extra(f"bench {name}", exc)   # listed, and says which extra to install
        bench_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(bench_module=module)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_module.run(args))
