"""Starting a gateway's agent on the path its options name: a UDP socket and, under ``xdp`` or ``auto``,
the XDP program on the LAN interface (``auto`` falls back to userspace aggregation when it cannot load),
or the TCP path's listener. Only sockets and the loader are touched here; what the agent then does is
bpf/agent.py's or bpf/tcpagent.py's, and ``GatewayRole._start`` runs this in a thread (loading XDP takes
seconds).

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from bpf.agent import EdgeAgent
from bpf.edgeoptions import EdgeOptions
from bpf.tcpagent import TcpEdgeAgent
from bpf.timer_link import LoaderError
from bpf.xdp import XdpAggregator
from netstorm.errors import ConfigError
from netstorm.lan import udp
from netstorm.lan.deploy import LanTopology
from netstorm.lan.layout import EdgeLayout
from netstorm.layout import Layout

log = logging.getLogger("netstorm.edge")


@dataclass(frozen=True)
class StartedAgent:
    """An agent serving the LAN, and what the role reports of how it aggregates."""

    agent: EdgeAgent | TcpEdgeAgent
    mode: str
    """``xdp (<attach mode>)``, ``userspace`` or ``tcp`` (``GatewayRole.mode``)."""
    fallback: str = ""
    """Why XDP could not load, when ``auto`` fell back to userspace."""
    xdp: XdpAggregator | None = None
    """The loaded XDP program (closed by its owner after the agent)."""


def start_agent(options: EdgeOptions, sizes: list[int], *, compressed: Layout | None,
                paces: Callable[[], dict[int, float]]) -> StartedAgent:
    """The agent for a model of ``sizes`` (float32 elements per tensor); ``compressed``: the registered
    layout of a sparse-compressed job (None: dense); ``paces``: each worker's pace in Gbit/s, asked once
    the UDP agent is made (a plan taken while XDP loads counts)."""
    layout = EdgeLayout.uniform(sizes, scale=options.scale, lanes=options.lanes, pool=options.pool_slots)
    if options.mode == "tcp":
        return _start_tcp(options, layout, compressed=compressed)
    topology = options.topology if options.topology is not None else LanTopology(options.workers)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(options.listen)
    sock.setblocking(False)
    if options.group is not None:
        ifindex = socket.if_nametoindex(options.interface) if options.interface else 0
        udp.multicast_from(sock, address=options.listen[0], ifindex=ifindex)
    xdp = None
    mode = "userspace"
    fallback = ""
    if options.mode in ("auto", "xdp"):
        try:
            xdp = XdpAggregator(layout, job=options.job, port=options.listen[1], expected=topology.gateway_mask(),
                                timeout=options.slot_timeout)
            assert options.interface is not None
            attached = xdp.attach(socket.if_nametoindex(options.interface))
            mode = f"xdp ({attached})"
        except (LoaderError, OSError) as exc:
            if xdp is not None:
                xdp.close()
                xdp = None
            if options.mode == "xdp":
                sock.close()
                raise
            log.warning("edge: XDP unavailable (%s); aggregating in userspace", exc)
            fallback = str(exc)
    agent = EdgeAgent(sock, layout, workers=options.workers, job=options.job,
                      mode="xdp" if xdp is not None else "userspace", xdp=xdp, slot_timeout=options.slot_timeout,
                      secret=options.secret, group=options.group, topology=topology, retransmit=options.retransmit,
                      query_nacks=options.query_nacks)
    if compressed is not None:
        agent.gia_threshold = compressed.gia_threshold
    agent.pace_gbit = paces()
    log.info("edge: gateway for %d LAN workers on %s:%d, %s aggregation, %d slots (%.1f MB), %s",
             options.workers, *options.listen, mode, layout.num_slots, layout.map_bytes / 1e6,
             "datagrams authenticated by tokens" if options.secret else "no secret: datagrams not authenticated")
    if agent.pace_gbit:
        log.info("edge: workers paced to their planned rates (Gbit/s): %s",
                 ", ".join(f"{w}: {r:.4g}" for w, r in sorted(agent.pace_gbit.items())))
    return StartedAgent(agent, mode, fallback, xdp)


def _start_tcp(options: EdgeOptions, layout: EdgeLayout, *, compressed: Layout | None) -> StartedAgent:
    """The TCP path: workers stream to ``listen`` over TCP (the same port number as the UDP paths')."""
    if compressed is not None:
        raise ConfigError("--edge-mode tcp carries dense gradients; a compressed job's LAN tier needs xdp or "
                          "userspace")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(options.listen)
    log.info("edge: gateway for %d LAN workers on %s:%d, tcp aggregation, %s", options.workers, *options.listen,
             "frames authenticated by tokens" if options.secret else "no secret: frames not authenticated")
    return StartedAgent(TcpEdgeAgent(sock, layout, workers=options.workers, job=options.job, secret=options.secret),
                        "tcp")
