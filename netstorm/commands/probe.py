"""``netstorm probe``: measure a job's WAN links with short bulk probes and write a scenario with the rates.

A scenario for real hosts may list only its DCs (with their addresses), or links without rates; the
probe fills the rates in. ``--emulate`` builds the emulated network of ``--applied`` (default: the
scenario itself), measures every directed link in it and checks each measurement against the rate
the emulator applied. On real hosts every DC runs ``--sink``, and each DC's host measures its own
outgoing links with ``--from DC`` (they are that host's to send on).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from netstorm import config as config_module
from netstorm import scenario as scenario_module
from netstorm.control import parse_address
from netstorm.errors import ConfigError

NAME = "probe"
HELP = "measure a job's WAN links with short bulk probes and write a scenario with the measured rates"
DEFAULT_BYTES = 4_000_000
DEFAULT_PORT = 9750


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario name (klonet-scenarios/) or TOML file; rates may be missing")
    where = parser.add_argument_group("where to measure (one of)")
    where.add_argument("--emulate", action="store_true",
                       help="build the emulated network (root) and measure every link in it")
    where.add_argument("--from", dest="from_dc", type=int, metavar="DC",
                       help="real hosts: measure the links from DC (this host) to its neighbours' addresses")
    where.add_argument("--sink", metavar="HOST:PORT", help="real hosts: answer the other DCs' probes until killed")
    where.add_argument("--scheduler", metavar="HOST:PORT",
                       help="a running job: what its nodes measured passively, as its scheduler believes it")
    probe = parser.add_argument_group("the probe")
    probe.add_argument("--bytes", type=int, default=DEFAULT_BYTES, metavar="N",
                       help=f"bytes per probe of a directed link, the faster of two kept; the second half is "
                            f"timed (default {DEFAULT_BYTES})")
    probe.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the sinks' port (default {DEFAULT_PORT})")
    probe.add_argument("--timeout", type=float, default=60.0, metavar="S",
                       help="seconds per link, both probes (default 60)")
    emulation = parser.add_argument_group("emulation")
    emulation.add_argument("--applied", metavar="SCENARIO",
                           help="the scenario whose rates the emulator applies (default: SCENARIO, which then "
                                "must state them)")
    emulation.add_argument("--bw-scale", type=float, default=1.0, metavar="X",
                           help="the emulator applies rates times X; measured rates are written divided by X")
    emulation.add_argument("--tolerance", type=float, default=0.15, metavar="F",
                           help="a measurement more than this fraction off the applied rate fails (default 0.15)")
    output = parser.add_argument_group("output")
    output.add_argument("--out", metavar="FILE", help="write the result here: the scenario with the measured rates "
                        "(--emulate), the measured links as JSON (--from)")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    config_module.add_arguments(parser, (), ("connect_timeout", "secret_file", "wan_tls", "log_format"))


def run(args: argparse.Namespace) -> int:
    config_module.from_args(args)
    if sum(bool(x) for x in (args.emulate, args.from_dc is not None, args.sink, args.scheduler)) != 1:
        raise ConfigError("give one of --emulate, --from DC, --sink HOST:PORT or --scheduler HOST:PORT")
    if args.sink:
        from netstorm.bulkprobe import main as bulk

        return bulk(["sink", args.sink])
    scenario = scenario_module.load(args.scenario)
    if args.emulate:
        measured, applied = _emulated(scenario, args)
    elif args.scheduler:
        measured, applied = from_scheduler(args), {}
    else:
        measured, applied = _from_host(scenario, args), {}
    rows = [{"src": a, "dst": b, "measured_mbit": round(rate, 3), "applied_mbit": None, "ratio": None}
            for (a, b), rate in sorted(measured.items())]
    if applied:
        from netstorm.emulation.linkprobe import comparison

        rows = comparison(measured, applied)
    off = [r for r in rows if r["ratio"] is not None and abs(r["ratio"] - 1) > args.tolerance]
    if args.out and args.from_dc is not None:  # one host's outgoing links: directed rows, for the links' other ends
        Path(args.out).write_text(json.dumps({"scenario": scenario.name, "from": args.from_dc, "links": rows},
                                             indent=1) + "\n")
    elif args.out:
        written = scenario.with_rates(measured)
        note = (f"{scenario.description.strip()}\nRates measured by netstorm probe ({args.bytes} bytes per link, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).")
        Path(args.out).write_text(scenario_module.to_toml(written, note))
    if args.json:
        print(json.dumps({"scenario": scenario.name, "links": rows, "tolerance": args.tolerance,
                          "off": len(off)}, indent=1))
    else:
        for r in rows:
            applied_text = f"{r['applied_mbit']:.1f}" if r["applied_mbit"] else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            print(f"{r['src']:>4}->{r['dst']:<4} measured {r['measured_mbit']:>9.1f} Mbit/s  applied "
                  f"{applied_text:>8}  ratio {ratio}")
        if applied:
            print(f"{len(rows) - len(off)} of {len(rows)} links within {args.tolerance:.0%} of the applied rate")
    return 1 if off else 0


def _emulated(scenario: scenario_module.Scenario, args: argparse.Namespace
              ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Every directed link measured in the emulated network of ``--applied``; (measured, applied), in the
    scenario's units (the emulator's rates divided by ``--bw-scale``)."""
    from netstorm.emulation.linkprobe import probe_links
    from netstorm.emulation.network import EmulatedNetwork

    truth = scenario_module.load(args.applied) if args.applied else scenario
    if truth.unknown:
        raise ConfigError(f"--emulate needs rates to apply: {truth.name} states none for "
                          f"{len(truth.unknown) // 2} link(s); name a scenario that does with --applied")
    want = {(lk.a, lk.b) for lk in scenario.links} | {(lk.b, lk.a) for lk in scenario.links}
    have = set(truth.rates())
    if not want <= have:
        raise ConfigError(f"--applied {truth.name} lacks links of {scenario.name}: {sorted(want - have)}")
    with EmulatedNetwork(truth, bw_scale=args.bw_scale, loss=False) as net:
        measured = probe_links(net, want, args.bytes, port=args.port, timeout=args.timeout)
    applied = {link: truth.rates()[link] for link in want}
    return measured, applied


def from_scheduler(args: argparse.Namespace) -> dict[tuple[int, int], float]:
    """A running job's links as its scheduler believes them (each link's newest report, its belief where
    none came): the rates its nodes measured passively from their chunks."""
    from netstorm.authconn import Credentials
    from scheduler import admin

    config = config_module.from_args(args)
    status = asyncio.run(admin.status(parse_address(args.scheduler, "--scheduler"), timeout=config.connect_timeout,
                                      credentials=Credentials.from_config(config)))
    return {(src, dst): measured if measured >= 0 else believed for src, dst, believed, measured, _ in status.links}


def _from_host(scenario: scenario_module.Scenario, args: argparse.Namespace) -> dict[tuple[int, int], float]:
    """The links from ``--from`` DC to each neighbour, probed at the neighbour's address (real hosts)."""
    from netstorm.bulkprobe import measure_best

    src = args.from_dc
    if src not in scenario.node_ids:
        raise ConfigError(f"--from {src}: {scenario.name} has DCs {scenario.node_ids}")
    measured: dict[tuple[int, int], float] = {}
    for dst in scenario.neighbors(src):
        address = scenario.node(dst).address
        if not address:
            raise ConfigError(f"DC {dst} of {scenario.name} states no address to probe")
        host, port = parse_address(address if ":" in address else f"{address}:{args.port}", f"DC {dst} address")
        measured[(src, dst)] = asyncio.run(measure_best(host, port, args.bytes, timeout=args.timeout))
    return measured
