"""``netstorm scheduler``: the central scheduler of one job (control TCP and SNTP on one address)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable

from netstorm import config as config_module
from netstorm import scenario as scenario_module
from netstorm.bulkprobe import DEFAULT_BYTES as PROBE_BYTES
from netstorm.control import PROBE_MAX_BYTES, format_address, parse_address
from netstorm.errors import ConfigError
from netstorm.topologies import NAMES as TOPOLOGIES

NAME = "scheduler"
HELP = "run the central scheduler: registration, heartbeats, policies per iteration, link reports, SNTP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario name (klonet-scenarios/) or TOML file")
    parser.add_argument("--listen", default="127.0.0.1:7700", metavar="HOST:PORT",
                        help="control TCP and SNTP UDP address (port 0 picks one; default 127.0.0.1:7700)")
    parser.add_argument("--nodes", metavar="IDS", help="comma-separated node ids to expect (default: the scenario's)")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="fapt", help="policy family (default fapt)")
    parser.add_argument("--roots", type=int, metavar="N", help="number of roots (default NUM_ROOT_SERVERS)")
    parser.add_argument("--bw-scale", type=float, default=1.0, metavar="X",
                        help="multiply the scenario's rates by X for the first plan (default 1)")
    parser.add_argument("--probe-bytes", type=int, default=PROBE_BYTES, metavar="N",
                        help=f"bytes of the bulk probe the nodes run on each link the scenario gives no rate, "
                             f"before the first policy (default {PROBE_BYTES}; 0: plan from the prior)")
    config_module.add_arguments(parser, config_module.JOB_SECTIONS)


def parse_nodes(text: str | None, scenario: scenario_module.Scenario) -> list[int]:
    known = scenario.node_ids
    if text is None:
        return known
    try:
        nodes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--nodes expects comma-separated integers, got {text!r}") from None
    unknown = [n for n in nodes if n not in known]
    if unknown or not nodes:
        raise ConfigError(f"--nodes {text}: unknown node(s) {unknown}; scenario {scenario.name} has {known}")
    return nodes


def run(args: argparse.Namespace) -> int:
    from netstorm.authconn import Credentials
    from scheduler.service import SchedulerService

    config = config_module.from_args(args)
    scenario = scenario_module.load(args.scenario)
    nodes = parse_nodes(args.nodes, scenario)
    if not args.bw_scale > 0:
        raise ConfigError(f"--bw-scale must be positive, got {args.bw_scale}")
    if args.roots is not None and args.roots < 0:
        raise ConfigError(f"--roots must be >= 0, got {args.roots}")
    host, port = parse_address(args.listen, "--listen")
    rates = {link: rate * args.bw_scale for link, rate in scenario.rates().items()}
    if args.probe_bytes != 0 and not 2 <= args.probe_bytes <= PROBE_MAX_BYTES:
        raise ConfigError(f"--probe-bytes must be 0 or 2..{PROBE_MAX_BYTES}, got {args.probe_bytes}")
    if scenario.unknown:  # the passive estimator measures them from the first iteration on
        how = (f"its nodes probe them ({args.probe_bytes} bytes each) before the first policy, which assumes the "
               f"prior {scenario.prior_mbit:g} Mbit/s where a probe fails" if args.probe_bytes else
               f"the first policy assumes the prior {scenario.prior_mbit:g} Mbit/s there")
        print(f"scheduler: {scenario.name} states no rate for {len(scenario.unknown)} directed link(s): {how}",
              file=sys.stderr, flush=True)
    service = SchedulerService(rates, nodes, config, topology=args.topology, num_roots=args.roots,
                               credentials=Credentials.from_config(config),
                               unknown=scenario.unknown if args.probe_bytes else (), probe_bytes=args.probe_bytes or 2)

    def ready(address: tuple[str, int]) -> None:
        print(f"scheduler listening on {format_address(address)} for nodes "
              f"{','.join(map(str, nodes))} ({scenario.name}, {args.topology})", flush=True)

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        metrics = None
        if config.metrics_listen:  # from the start: its gauges have samples before any node registers
            from netstorm.metricserve import serve_metrics
            from scheduler.metrics import renderer

            metrics = await serve_metrics(config.metrics_listen, renderer(service))
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await service.serve(host, port, ready=ready)
        finally:
            if metrics is not None:
                metrics.close()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
    print("scheduler stopped", file=sys.stderr, flush=True)
    return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (it is a dependency; the fallback keeps a broken install debuggable)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
