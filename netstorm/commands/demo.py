"""``netstorm demo``: the main command: dynamic internet2-9, NetStorm against STAR (and gloo), in minutes.

Rates x0.25 and a 5 MB model keep the run network-bound on a small host; the dynamics period is
scaled to 18 s so the rates change several times while it runs. Everything else is ``netstorm
emulate`` with these settings, so a larger run is that command with other flags. ``--lan-workers N``
puts N LAN workers behind every DC's gateway (aggregated in XDP where it loads); a scenario file with
``lan_workers`` brings its own; ``--dc-planner P`` plans the tier of every DC with LAN workers: a DC
whose LAN the scenario describes at another count, or not at all (the default scenario describes none),
gets N described workers (``runner.resize_lans``), and the result file says which planner each DC ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

NAME = "demo"
HELP = "run the demo: dynamic internet2-9, netstorm vs star (and gloo), table and plots (root)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default="demo-results", help="where the result JSON and plots go")
    parser.add_argument("--scenario", default="internet2-9-dynamic")
    parser.add_argument("--system", dest="systems", default=None, metavar="NAMES",
                        help="comma-separated systems (default: netstorm,star plus gloo when torch is installed)")
    parser.add_argument("--systems", dest="systems", help=argparse.SUPPRESS)  # the former name
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--model", default="1.25M", help="parameters (default 1.25M = 5 MB of float32)")
    parser.add_argument("--bw-scale", type=float, default=0.25)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--lan-workers", type=int, default=None, metavar="N",
                        help="LAN workers behind every DC's gateway (default: the scenario's, none in the "
                             "built-in ones); each is one more trainer process, so keep N small on a small host")
    parser.add_argument("--edge-mode", choices=("auto", "xdp", "userspace", "tcp"), default="auto",
                        help="how gateways aggregate their LAN workers (default auto: each path measured, the "
                             "faster taken)")
    parser.add_argument("--dc-planner", choices=("flat", "aleph", "pahina", "eina"), default=None,
                        help="plan the LAN tier of every DC with LAN workers (dc_planner); with --lan-workers N a DC "
                             "whose LAN the scenario does not describe at N gets N described workers (resized, or "
                             "the format's defaults); aggregator workers run netstorm lan-aggregator")
    parser.add_argument("--secret-file", metavar="FILE", default=None,
                        help="job secret every process of the run proves (see `netstorm secret`; default none: "
                             "the emulated network is private to this host)")
    parser.add_argument("--wan-tls", metavar="BOOL", default=None,
                        help="encrypt the emulated WAN links with the job certificate beside --secret-file")
    parser.add_argument("--results", metavar="DIR", default=None,
                        help="instead: the committed results: static and dynamic internet2-9 with every system, "
                             "written to DIR (about half an hour)")


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("netstorm demo: the WAN emulation needs root (network namespaces and tc); run it as root",
              file=sys.stderr)
        return 2
    from netstorm.commands import emulate

    if args.results:
        return _results(args, Path(args.results))
    argv = emulate_argv(args)
    parser = argparse.ArgumentParser(prog="netstorm emulate")
    emulate.add_arguments(parser)
    print(f"netstorm demo: netstorm emulate {' '.join(argv)}", file=sys.stderr)
    return emulate.run(parser.parse_args(argv))


def emulate_argv(args: argparse.Namespace) -> list[str]:
    """The ``netstorm emulate`` arguments the demo runs."""
    systems = args.systems or ("netstorm,star,gloo" if importlib.util.find_spec("torch") else "netstorm,star")
    out_dir = Path(args.out_dir)
    return [args.scenario, "--system", systems, "--iterations", str(args.iterations), "--model", args.model,
            "--bw-scale", str(args.bw_scale), "--time-scale", str(args.time_scale),
            "--out", str(out_dir / "demo.json"), "--plots", str(out_dir), *_lan_flags(args)]


def _lan_flags(args: argparse.Namespace) -> list[str]:
    """The LAN flags and the trust flags, passed on to ``netstorm emulate`` as given."""
    flags = ["--edge-mode", args.edge_mode]
    if args.lan_workers is not None:
        flags += ["--lan-workers", str(args.lan_workers)]
    if getattr(args, "dc_planner", None):
        flags += ["--dc-planner", args.dc_planner]
    if getattr(args, "secret_file", None):
        flags += ["--secret-file", str(Path(args.secret_file).resolve())]
    if getattr(args, "wan_tls", None) is not None:
        flags += ["--wan-tls", str(args.wan_tls)]
    return flags


def _results(args: argparse.Namespace, out_dir: Path) -> int:
    """Static and dynamic internet2-9, every system, one after the other; one JSON and plot set each."""
    from netstorm.commands import emulate

    systems = args.systems or "netstorm,lite,std,star,bkt,mst,fapt,gloo"
    status = 0
    for scenario in ("internet2-9", "internet2-9-dynamic"):
        argv = [scenario, "--system", systems, "--iterations", str(args.iterations), "--model", args.model,
                "--bw-scale", str(args.bw_scale), "--time-scale", str(args.time_scale),
                "--out", str(out_dir / f"{scenario}.json"), "--plots", str(out_dir), *_lan_flags(args)]
        parser = argparse.ArgumentParser(prog="netstorm emulate")
        emulate.add_arguments(parser)
        print(f"netstorm demo: netstorm emulate {' '.join(argv)}", file=sys.stderr)
        status = max(status, emulate.run(parser.parse_args(argv)))
        if status >= 128:  # stopped by a signal: the user wants out, not the next scenario
            return status
    return status
