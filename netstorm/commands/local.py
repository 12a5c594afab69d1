"""``netstorm local``: a scheduler and one node per DC on loopback, stopped cleanly by Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from netstorm import config as config_module
from netstorm import scenario as scenario_module
from netstorm.commands.scheduler import parse_nodes
from netstorm.topologies import NAMES as TOPOLOGIES

NAME = "local"
HELP = "run a scheduler and one node per DC on 127.0.0.1 (trainer sockets at RUN_DIR/node-<i>.sock)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario name (klonet-scenarios/) or TOML file")
    parser.add_argument("--run-dir", metavar="DIR", help="sockets and logs (default: a new temporary directory)")
    parser.add_argument("--nodes", metavar="IDS", help="comma-separated node ids to start (default: every DC)")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="fapt", help="policy family (default fapt)")
    parser.add_argument("--roots", type=int, metavar="N", help="number of roots (default NUM_ROOT_SERVERS)")
    parser.add_argument("--bw-scale", type=float, default=1.0, metavar="X",
                        help="multiply the scenario's rates by X for the first plan (default 1)")
    parser.add_argument("--startup-timeout", type=float, default=120.0, metavar="S",
                        help="seconds for every node to register and serve (default 120)")
    parser.add_argument("--keep-going", action="store_true",
                        help="a node that dies is reported and the job goes on without its DC (default: the "
                             "run stops with its log tail)")
    config_module.add_arguments(parser, config_module.JOB_SECTIONS)


def config_flags(args: argparse.Namespace) -> list[str]:
    """The config flags given on this command line, to repeat for every child."""
    out: list[str] = []
    if getattr(args, "config", None):
        out += ["--config", str(Path(args.config).resolve())]
    for name in config_module.FIELDS:
        if name == "metrics_listen":
            continue  # one address per child (LocalCluster.metrics_listen)
        value = getattr(args, f"opt_{name}", None)
        if value is not None:
            if name == "secret_file" and value:
                value = str(Path(value).resolve())
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def run(args: argparse.Namespace) -> int:
    from netstorm.authconn import Credentials
    from netstorm.local import LocalCluster, run_local

    config = config_module.from_args(args)  # fail here, once, on a bad option
    scenario = scenario_module.load(args.scenario)
    nodes = parse_nodes(args.nodes, scenario)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="netstorm-local-"))
    scheduler_args = ["--topology", args.topology, "--bw-scale", str(args.bw_scale)]
    if args.nodes:
        scheduler_args += ["--nodes", ",".join(map(str, nodes))]
    if args.roots is not None:
        scheduler_args += ["--roots", str(args.roots)]
    cluster = LocalCluster(
        scenario=str(Path(scenario.source).resolve()) if Path(scenario.source).exists() else args.scenario,
        node_ids=nodes, run_dir=run_dir.resolve(), scheduler_args=scheduler_args, common_args=config_flags(args),
        verbose=args.verbose, startup_timeout=max(args.startup_timeout, config.connect_timeout),
        credentials=Credentials.from_config(config), keep_going=args.keep_going, metrics_listen=config.metrics_listen)
    return asyncio.run(run_local(cluster))
