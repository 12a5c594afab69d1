"""``netstorm emulate``: build the emulated WAN of a scenario and run systems on it, or clean up."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

NAME = "emulate"
HELP = "emulate a scenario's WAN in network namespaces and run training systems on it (root)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", help="scenario file or name (e.g. internet2-9-dynamic)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces, links, processes and mounts left by killed runs, then exit")
    parser.add_argument("--hold", action="store_true",
                        help="build the network, print READY <run-id> and its addresses, wait for Ctrl-C")
    parser.add_argument("--bw-scale", type=float, default=1.0, help="multiply every link rate (default 1)")
    parser.add_argument("--no-loss", action="store_true", help="do not apply the scenario's packet loss")
    from netstorm.emulation.runner import add_run_arguments

    add_run_arguments(parser)


class Terminated(Exception):
    """SIGTERM arrived: unwinds like Ctrl-C so every ``finally`` tears its part down."""


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into an exception in the main thread for the duration."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run(args: argparse.Namespace) -> int:
    import os

    from netstorm.emulation import teardown

    if os.geteuid() != 0:
        print("netstorm emulate: needs root (network namespaces, veth, tc); run it as root", file=sys.stderr)
        return 2

    if args.cleanup:
        report = teardown.cleanup()
        for line in report.lines():
            print(line)
        if args.scenario is None:
            return 0
    if args.scenario is None:
        print("netstorm emulate: a SCENARIO is required (or --cleanup)", file=sys.stderr)
        return 2
    try:
        with terminate_on_sigterm():
            if args.hold:
                return _hold(args)
            if getattr(args, "trainer", None) == "diloco":
                from netstorm.emulation import diloco_emu

                return diloco_emu.run_from_args(args)
            from netstorm.emulation.runner import run_from_args

            return run_from_args(args)
    except Terminated as exc:
        print(f"netstorm emulate: stopped by {exc}; everything was torn down", file=sys.stderr)
        return 143


def _hold(args: argparse.Namespace) -> int:
    from netstorm.emulation.network import EmulatedNetwork
    from netstorm.emulation.runner import _given_options, lan_options, with_lan_workers
    from netstorm.scenario import load

    scenario = with_lan_workers(load(args.scenario), args.lan_workers)
    lan = lan_options(_given_options(args))
    with EmulatedNetwork(scenario, bw_scale=args.bw_scale, loss=not args.no_loss, lan_bw_scale=lan.lan_bw_scale,
                         lan_uplink=lan.lan_uplink_shaping) as net:
        for line in net.features.lines():
            print(line)
        for dc in net.plan.node_ids:
            print(f"DC {dc}: namespace {net.namespace(dc)} node address {net.node_address(dc)} "
                  f"management {net.plan.mgmt_address(dc)}")
        for dc, lan in sorted(net.plan.lans.items()):
            workers = ", ".join(f"{ns} {addr}" for ns, addr in zip(lan.worker_namespaces, lan.worker_addresses,
                                                                   strict=True))
            print(f"DC {dc} LAN: gateway {lan.gateway_address} on {lan.gateway_iface}; workers {workers}")
        print(f"scheduler/management namespace {net.plan.mgmt_namespace} address {net.scheduler_host}")
        print(f"READY {net.run_id}", flush=True)
        stop = threading.Event()
        try:
            while not stop.wait(3600):
                pass
        except KeyboardInterrupt:
            print("tearing down", file=sys.stderr)
    return 0
