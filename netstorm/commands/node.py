"""``netstorm node``: the general node of one DC (data plane, trainer endpoint, scheduler client)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from netstorm import config as config_mod
from netstorm.control import parse_address

if TYPE_CHECKING:
    from bpf.gateway import EdgeOptions
    from netstorm.lan_scenario import LanSpec

NAME = "node"
HELP = "run the general node of one DC: peers over TCP, trainers over a Unix socket (and TCP)"

log = logging.getLogger("netstorm.node")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", type=int, required=True, help="this DC's node id (as in the scenario)")
    parser.add_argument("--scheduler", required=True, metavar="HOST:PORT", help="the scheduler's control address")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="data-plane address to listen on (port 0 picks a free one)")
    parser.add_argument("--advertise", metavar="HOST:PORT",
                        help="data-plane address peers connect to (default: the bound --listen address)")
    parser.add_argument("--socket", required=True, metavar="PATH", help="Unix socket for local trainers")
    parser.add_argument("--socket-group", metavar="GROUP",
                        help="users of GROUP may connect to --socket too (mode 0660; default 0600: only the node's "
                             "user, and root)")
    parser.add_argument("--trainer-tcp", metavar="HOST:PORT",
                        help="also serve trainers over TCP here (with a job secret, trainers must prove it)")
    edge = parser.add_argument_group("gateway role: aggregate this DC's LAN workers (edge mode trainers)")
    edge.add_argument("--edge-workers", type=int, default=0, metavar="N",
                      help="LAN workers to aggregate (ids 0..N-1); 0 disables the gateway role")
    edge.add_argument("--edge-listen", default=f"0.0.0.0:{9700}", metavar="HOST:PORT",
                      help="address the LAN workers send to: UDP, or TCP with --edge-mode tcp (default 0.0.0.0:9700)")
    edge.add_argument("--edge-interface", metavar="IFACE", help="LAN-facing interface for the XDP aggregator")
    edge.add_argument("--edge-mode", choices=("auto", "xdp", "userspace", "tcp"), default="auto",
                      help="xdp, the userspace fallback, tcp (workers stream over TCP, summed in numpy), or auto "
                           "(xdp, falling back to userspace when it cannot load; the emulator and `bench edge` "
                           "measure all three and pass the faster)")
    edge.add_argument("--edge-scale", type=int, default=16,
                      help="fixed-point scale: LAN lanes carry round(x * 2**scale) (default 16)")
    edge.add_argument("--edge-slot-timeout", type=float, default=0.2,
                      help="seconds before a slot missing workers makes the gateway NACK them (default 0.2)")
    edge.add_argument("--edge-scenario", metavar="SCENARIO",
                      help="scenario (name or file) whose DC --id describes this LAN: announced to the scheduler, "
                           "which plans the tier with dc_planner and pushes the plan")
    edge.add_argument("--edge-lan", metavar="FILE",
                      help="instead of --edge-scenario: a file holding this LAN's description alone (the scenario "
                           "format's [node.lan] table at the top level; the emulator writes one per planned DC)")
    config_mod.add_arguments(parser, ("Runtime", "Trust", "Operations", "LAN tier"), ("scheduler_grace",))


def lan_description(scenario: str | None, node_id: int, lan_file: str | None = None) -> LanSpec | None:
    """The LAN of DC ``node_id`` as ``lan_file`` or ``scenario`` describes it (None without either);
    ConfigError when the scenario's DC describes none."""
    if lan_file:
        from netstorm.lan_scenario import load_lan_file

        return load_lan_file(lan_file)
    if not scenario:
        return None
    from netstorm.errors import ConfigError
    from netstorm.scenario import load

    lan = load(scenario).node(node_id).lan
    if lan is None:
        raise ConfigError(f"--edge-scenario {scenario}: DC {node_id} describes no LAN ([node.lan])")
    return lan


def run(args: argparse.Namespace) -> int:
    config = config_mod.from_args(args)
    scheduler = parse_address(args.scheduler, "--scheduler")
    listen = parse_address(args.listen, "--listen")
    advertise = parse_address(args.advertise, "--advertise") if args.advertise else None
    trainer_tcp = parse_address(args.trainer_tcp, "--trainer-tcp") if args.trainer_tcp else None
    edge = None
    if args.edge_workers:
        from bpf.gateway import EdgeOptions
        from netstorm.lan.deploy import LanTopology

        edge = EdgeOptions(workers=args.edge_workers, listen=parse_address(args.edge_listen, "--edge-listen"),
                           interface=args.edge_interface, mode=args.edge_mode, scale=args.edge_scale,
                           slot_timeout=args.edge_slot_timeout, secret=edge_secret(config),
                           pool_slots=config.edge_pool_slots, mtu=config.edge_mtu,
                           topology=LanTopology.parse(config.edge_clusters, args.edge_workers)
                           if config.edge_clusters else None,
                           group=parse_address(config.edge_group, "edge_group") if config.edge_group else None,
                           retransmit=config.edge_retransmit, query_nacks=config.edge_query_nacks,
                           lan=lan_description(getattr(args, "edge_scenario", None), args.id,
                                                  getattr(args, "edge_lan", None)),
                           plan_wait=config.edge_plan_wait, report_change=config.dc_replan_change,
                           report_interval=config.dc_replan_hold, pace_rates=config.dc_pace_rates,
                           rate_scale=config.lan_bw_scale)
    import uvloop

    return uvloop.run(serve(args.id, config, scheduler=scheduler, listen=listen, advertise=advertise,
                            socket_path=Path(args.socket), trainer_tcp=trainer_tcp, edge=edge,
                            socket_group=args.socket_group))


def edge_secret(config: object) -> bytes | None:
    """The job secret for the LAN tier: the bytes of ``secret_file`` when the configuration names one."""
    path = getattr(config, "secret_file", None)
    return Path(path).read_bytes() if path else None


async def serve(node_id: int, config: config_mod.Config, *, scheduler: tuple[str, int], listen: tuple[str, int],
                advertise: tuple[str, int] | None, socket_path: Path, trainer_tcp: tuple[str, int] | None,
                edge: EdgeOptions | None = None, socket_group: str | None = None) -> int:
    """Run one node until SIGTERM/SIGINT, or until the scheduler is gone for longer than scheduler_grace
    (or refuses to take the node back)."""
    from netstorm.authconn import Credentials
    from netstorm.clock import Clock, ClockSyncError
    from node.control_client import SchedulerClient
    from node.service import GeneralNode
    from node.trainer_endpoint import TrainerEndpoint

    clock = Clock.from_env()
    try:
        offset = await clock.sync(scheduler[0], scheduler[1], timeout=config.connect_timeout)
        log.info("node %d: clock offset to the scheduler %+.6f s (skew %+.3f s)", node_id, offset, clock.skew)
    except ClockSyncError as exc:
        log.warning("node %d: %s; timestamps stay uncorrected until a later sync succeeds", node_id, exc)
    credentials = Credentials.from_config(config)
    node = GeneralNode(node_id, config, clock=clock.now, credentials=credentials)
    metrics = None  # served from the start, before the node registers
    if config.metrics_listen:
        from netstorm.metricserve import serve_metrics
        from node.metrics import renderer

        metrics = await serve_metrics(config.metrics_listen, renderer(node))
    bound = await node.serve_data(*listen)
    data_address = advertise or bound
    log.info("node %d: data plane on %s:%d", node_id, *bound)
    # this DC's contributions sum its trainers' gradients and (as a gateway) its LAN workers'
    workers = config.trainers + (edge.workers if edge is not None else 0)
    control = await SchedulerClient.connect(scheduler, node_id, data_address, timeout=config.connect_timeout,
                                            workers=workers, credentials=credentials, probe_host=listen[0])
    control.progress = node.progress
    endpoint = TrainerEndpoint(node, credentials=credentials)

    def scheduler_lost(error: Exception) -> None:
        log.error("node %d: lost the scheduler: %s; stopping", node_id, error)
        node.stop(f"lost the scheduler: {error}")
    control.on_lost(scheduler_lost)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.stop, f"{signal.Signals(sig).name} received")
    try:
        await endpoint.serve_unix(socket_path, group=socket_group)
        if trainer_tcp is not None:
            server = await endpoint.serve_tcp(*trainer_tcp)
            log.info("node %d: trainers over TCP on %s", node_id, server.sockets[0].getsockname())
        print(f"node {node_id} serving: trainers at {socket_path}, data plane at {data_address[0]}:"
              f"{data_address[1]}, members {sorted(control.members)}", flush=True)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(node.run(control))
            edge_task = None
            if edge is not None:
                from bpf.gateway import GatewayRole
                from netstorm.lanreport import report_from_spec

                role = GatewayRole(edge, iteration_timeout=control.config.iteration_timeout)
                role.on_started = control.report_edge  # the emulator reads the mode back from the scheduler
                node.edge = role
                report = role.announce(node_id, clock.now())
                if report is not None:
                    control.report_lan(report)  # the scheduler answers with a LanPlan (GeneralNode._lan_plan)
                    role.on_measured = lambda spec: control.report_lan(
                        report_from_spec(node_id, spec, measured=True, t=clock.now()))
                edge_task = tg.create_task(role.run())
                print(f"node {node_id} gateway: {edge.workers} LAN workers send to {edge.listen[0]}:"
                      f"{edge.listen[1]} (edge://HOST:{edge.listen[1]}?worker=I)", flush=True)
            clock_task = tg.create_task(clock.keep_synced(scheduler[0], scheduler[1],
                                                          interval=control.config.clock_sync_interval,
                                                          timeout=config.connect_timeout))
            await node.wait_stopped()
            clock_task.cancel()
            if edge_task is not None:
                edge_task.cancel()
    finally:
        endpoint.close()
        if metrics is not None:
            metrics.close()
        await control.leave("stopped")
        await asyncio.to_thread(socket_path.unlink, missing_ok=True)
    return 0
