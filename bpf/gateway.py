"""The gateway role of a general node: its LAN workers' sum joins the DC's contribution, and the WAN result
goes back to them.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bpf.agent import EdgeAgent, IterationSums
from bpf.lanparts import PartReadiness
from bpf.tcpagent import TcpEdgeAgent, TcpPartial
from bpf.timer_link import LoaderError
from netstorm.compression.options import CompressionOptions
from netstorm.control import LanPlan, LanReport
from netstorm.errors import ConfigError, NetStormError
from netstorm.lan import udp
from netstorm.lan.deploy import LanTopology
from netstorm.lan.errors import EdgeTimeout, IterationAborted, ServicesMissing, WireError
from netstorm.lan.header import lanes_for_mtu
from netstorm.lan.introunds import GatewayRounds, RoundPlan
from netstorm.lan.layout import DEFAULT_POOL, EdgeLayout
from netstorm.lan_scenario import LanSpec
from netstorm.lanreport import LanRateMeter, ReportSchedule, report_from_spec, uplink_bounds
from netstorm.layout import Layout

log = logging.getLogger("netstorm.edge")
DEFAULT_SCALE = 16
DEFAULT_PORT = 9700
EDGE_MODES = ("auto", "xdp", "userspace", "tcp")
"""``--edge-mode``: XDP, the userspace fallback, the TCP path, or auto (netstorm/lan/pathpick.py)."""


@dataclass(frozen=True)
class EdgeOptions:
    """``netstorm node --edge-*``: where the LAN workers send and how to aggregate them."""

    workers: int
    """LAN workers (the DC then contributes ``1 + workers`` workers' gradients, its own trainer's too)."""
    listen: tuple[str, int]
    interface: str | None = None
    mode: str = "auto"
    scale: int = DEFAULT_SCALE
    slot_timeout: float = 0.2
    job: int = 1
    secret: bytes | None = field(default=None, repr=False)
    """The job secret: LAN datagrams carry tokens derived from it and are checked (None: unauthenticated)."""
    pool_slots: int = DEFAULT_POOL
    """Slots reused across chunks and iterations (``edge_pool_slots``; 0: one per chunk of the model)."""
    mtu: int = 1500
    """The LAN's IPv4 MTU (``edge_mtu``): lanes per datagram follow from it."""
    topology: LanTopology | None = None
    """Who aggregates whom (``edge_clusters``; None: one level, every worker sends to the gateway)."""
    group: tuple[str, int] | None = None
    """Multicast group for ACKs and results (``edge_group``; None: unicast)."""
    retransmit: float = 0.005
    """Seconds a worker waits for an ACK before resending (``edge_retransmit``)."""
    query_nacks: bool = True
    """Workers ask before resending; QUERYs are answered with NACKs of the missing (``edge_query_nacks``)."""
    lan: LanSpec | None = None
    """The LAN's description (``--edge-scenario``): announced to the scheduler, which plans the tier."""
    plan_wait: float = 0.0
    """Seconds the LAN tier waits at start for the scheduler's first plan (``edge_plan_wait``; 0: it
    starts with the configured topology, and a plan that arrives later switches it at an iteration
    boundary)."""
    report_change: float = 0.2
    """A measured worker rate that moved this much (relative) against the last report is reported
    (``dc_replan_change``, the scheduler's own threshold)."""
    report_interval: float = 10.0
    """Least seconds between two measured reports (``dc_replan_hold``; 0: after any iteration)."""
    pace_rates: bool = False
    """Each worker is told to pace its DATA to its rate in the plan (``dc_pace_rates``)."""
    rate_scale: float = 1.0
    """What the plan's rates are multiplied by to be the LAN's (``lan_bw_scale``: an emulated LAN is
    shaped to its description's rates times it, and the plan is made from the description)."""

    @property
    def lanes(self) -> int:
        return lanes_for_mtu(self.mtu)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 64:
            raise ConfigError(f"--edge-workers must be in 1..64, got {self.workers}")
        if self.mode not in EDGE_MODES:
            raise ConfigError(f"--edge-mode must be one of {', '.join(EDGE_MODES)}, got {self.mode!r}")
        if self.mode == "tcp" and self.topology is not None and self.topology.clusters:
            raise ConfigError("--edge-mode tcp is one level (every worker streams to the gateway); edge_clusters "
                              "needs xdp or userspace")
        if self.mode in ("auto", "xdp") and not self.interface:
            raise ConfigError(f"--edge-mode {self.mode} needs --edge-interface (the LAN-facing interface)")
        if self.topology is not None and self.topology.workers != self.workers:
            raise ConfigError(f"edge_clusters describes {self.topology.workers} workers, --edge-workers is "
                              f"{self.workers}")
        if self.lan is not None and len(self.lan.workers) != self.workers:
            raise ConfigError(f"the LAN description has {len(self.lan.workers)} workers, --edge-workers is "
                              f"{self.workers}")
        if self.plan_wait < 0:
            raise ConfigError(f"edge_plan_wait must be >= 0 seconds, got {self.plan_wait!r}")


def topology_from_plan(plan: LanPlan, workers: int) -> LanTopology:
    """The data plane's configuration of a ``LanPlan``: its clusters; every worker it sends straight to
    the gateway (or does not name) is unclustered. ConfigError when it names workers this LAN lacks."""
    clusters, _direct = plan.two_level()
    return LanTopology(workers, {a: tuple(m) for a, m in clusters.items()})


@dataclass
class _PartWatch:
    """One iteration's LAN sums as the node takes them part by part (``GatewayRole.combine_parts``)."""

    readiness: PartReadiness
    sums: IterationSums | TcpPartial
    pending: dict[int, list[int]] = field(default_factory=dict)
    """tensor -> its parts ready and not handed yet."""
    waiters: dict[int, asyncio.Event] = field(default_factory=dict)
    """tensor -> set when a part of it became ready or the iteration's collection ended."""
    handed: int = 0
    first_handed: float | None = None
    """When the node was handed the iteration's first part (monotonic clock; the phase log's figure)."""


class GatewayRole:
    """The node's gateway role: owns the EdgeAgent (created once the node knows its layout) that drives
    the XDP or userspace aggregator, and broadcasts the WAN results to the LAN workers."""

    def __init__(self, options: EdgeOptions, *, iteration_timeout: float) -> None:
        self.options = options
        self.iteration_timeout = iteration_timeout
        self.agent: EdgeAgent | TcpEdgeAgent | None = None
        self.mode = "not started"
        self.fallback = ""
        """Why XDP could not load, when ``mode`` fell back to userspace."""
        self.on_started: Callable[[str, str], None] | None = None
        """Called with ``mode`` and ``fallback`` once the gateway serves its LAN (the node tells the scheduler)."""
        self.init_iteration: int | None = None
        self._xdp: object | None = None
        self._released_at: dict[int, float] = {}
        """When each recent iteration's result was released to the LAN (the phase log's reference)."""
        self._started = asyncio.Event()
        self._starting = asyncio.Lock()
        self._lan: dict[int, asyncio.Task[list[np.ndarray] | NetStormError]] = {}
        self._watches: dict[int, _PartWatch] = {}
        """Iterations whose tensors are handed to the node part by part (``combine_parts``)."""
        self._results: asyncio.Queue[tuple[int, list[np.ndarray], int]] = asyncio.Queue(maxsize=4)
        self._tg: asyncio.TaskGroup | None = None
        self.plan: LanPlan | None = None
        """The scheduler's plan the running (or next) deployment follows."""
        self.pending: LanPlan | None = None
        """A newer plan with another deployment, received once the LAN tier ran: it runs from the iteration after
        the next released result (``_switch``)."""
        self._planned = asyncio.Event()
        self.meter = (LanRateMeter(options.lan, margin=options.report_change) if options.lan is not None
                      else None)
        """Each worker's achieved rates, from the data the gateway receives (netstorm/lanreport.py)."""
        self.schedule = (ReportSchedule(options.lan, options.report_change, options.report_interval)
                         if options.lan is not None else None)
        self.on_measured: Callable[[LanSpec], None] | None = None
        """Called with the measured LAN when it moved enough to tell the scheduler (the node sends it as a
        ``LanReport``, measured)."""
        self.clock: Callable[[], float] = time.monotonic
        self._compression: tuple[Layout, CompressionOptions] | None = None
        self.rounds: GatewayRounds | None = None
        """A compressed job's wires, one per iteration (planned as each result is released)."""
        self._wired = asyncio.Event()
        self.lan_iterations = 0
        """Iterations whose LAN sums this gateway collected."""
        self.lan_failures = 0
        """Iterations whose LAN sum failed (a timeout naming missing workers, an overflow, an abort)."""
        self.lan_bytes = 0
        """Bytes of float32 gradients the LAN summed: the model's size times the workers, per iteration."""
        self.lan_seconds = 0.0
        """Seconds of the LAN phases: from the previous result's release to the last chunk summed."""
        self.lan_last_gbit = 0.0
        """The newest LAN phase's throughput (its bytes over its seconds), Gbit/s; 0 before one."""
        self._model_bytes = 0
        self._released: deque[int] = deque(maxlen=8)
        """The newest iterations whose results went back: a failure reported for one of them is ignored
        (its workers have, or can PULL, the result)."""

    def announce(self, node_id: int, t: float = 0.0) -> LanReport | None:
        """The ``LanReport`` describing this gateway's LAN (None without a description)."""
        if self.options.lan is None:
            return None
        return report_from_spec(node_id, self.options.lan, t=t)

    def apply_lan_plan(self, plan: LanPlan) -> None:
        """Take the scheduler's plan of this LAN: its two-level form is the deployment if the LAN tier has
        not started, else a changed one waits as ``pending`` for the next released result (see the module's
        docstring)."""
        if self.plan is not None and plan.version <= self.plan.version:
            return
        try:
            topology = topology_from_plan(plan, self.options.workers)
        except ConfigError as exc:
            log.error("edge: %s plan %d ignored: %s", plan.planner, plan.version, exc)
            return
        if self.options.mode == "tcp" and topology.clusters:
            log.error("edge: %s plan %d has clusters; the tcp path is one level and keeps every worker sending "
                      "to the gateway", plan.planner, plan.version)
            return
        current = self.options.topology if self.options.topology is not None else LanTopology(self.options.workers)
        if self.agent is None:
            self.options = dataclasses.replace(self.options, topology=topology)
        elif topology != current:
            self.pending = plan
            log.info("edge: %s plan %d arrived while the LAN tier runs; its deployment (clusters %s) takes "
                     "effect from the iteration after the next released result", plan.planner, plan.version,
                     dict(topology.clusters))
            return
        self.plan = plan
        self.pending = None
        self._planned.set()
        if isinstance(self.agent, EdgeAgent):   # new rates reach the workers that say HELLO from now on
            self.agent.pace_gbit = self.paces()
        log.info("edge: %s plan %d deployed: clusters %s; the aggregators and unclustered workers %s send to the "
                 "gateway", plan.planner, plan.version, dict(topology.clusters), list(topology.unclustered))

    def paces(self) -> dict[int, float]:
        """Per worker, the Gbit/s its HELLO answer tells it to pace to: the plan's rate x ``rate_scale``
        with ``pace_rates``, else none."""
        if not self.options.pace_rates or self.plan is None:
            return {}
        return {w: r * self.options.rate_scale for w, r in self.plan.rates if r > 0}

    async def wait_plan(self) -> None:
        """Wait up to ``plan_wait`` seconds for the first plan (only when the LAN was announced)."""
        if self.options.lan is None or self.options.plan_wait <= 0 or self._planned.is_set():
            return
        try:
            async with asyncio.timeout(self.options.plan_wait):
                await self._planned.wait()
        except TimeoutError:
            log.warning("edge: no LAN plan within %.1f s; the LAN tier starts with the configured topology",
                        self.options.plan_wait)

    def deploy(self, topology: LanTopology) -> None:
        """Take a new two-level configuration (from the planner) before the LAN starts: the gateway's
        expected contributors and every worker's HELLO answer follow it."""
        if self.agent is not None:
            raise RuntimeError("edge: the LAN topology is deployed before the first iteration")
        self.options = dataclasses.replace(self.options, topology=topology)

    def compressed(self, layout: Layout, options: CompressionOptions) -> None:
        """The job runs a sparse compression (the node's trainer registered its integer tensors): the LAN
        workers run the same rounds, each on its own wire (``netstorm/lan/introunds.py``), planned here."""
        self._compression = (layout, options)

    def _plan_rounds(self, iteration: int, workers: int) -> None:
        """After the init iteration's result: the first summed iteration's wire."""
        assert self._compression is not None and isinstance(self.agent, EdgeAgent)
        layout, options = self._compression
        registered = {t.name: np.zeros(t.size, t.dtype) for t in layout.tensors}
        plan = RoundPlan(registered, options, lanes=self.agent.layout.lanes, pool=self.agent.layout.num_slots,
                         scale=self.options.scale, contributors=max(1, workers), applied=layout.gia_threshold)
        self.rounds = GatewayRounds(plan, iteration + 1)
        wire = self.rounds.wire_of(iteration + 1)
        self.agent.plan(iteration + 1, wire.layout, integer=wire.integer, back=wire.back)

    async def _wire(self, iteration: int) -> GatewayRounds:
        """The compressed job's rounds once ``iteration``'s wire is planned (its previous result released)."""
        try:
            async with asyncio.timeout(self.iteration_timeout):
                while self.rounds is None or iteration not in self.rounds.wires:
                    await self._wired.wait()
        except TimeoutError:
            raise EdgeTimeout(f"edge: iteration {iteration} has no wire: the previous result was never "
                              f"released") from None
        return self.rounds

    def _start(self, sizes: list[int]) -> EdgeAgent | TcpEdgeAgent:
        opts = self.options
        topology = opts.topology if opts.topology is not None else LanTopology(opts.workers)
        layout = EdgeLayout.uniform(sizes, scale=opts.scale, lanes=opts.lanes, pool=opts.pool_slots)
        if opts.mode == "tcp":
            return self._start_tcp(layout)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind(opts.listen)
        sock.setblocking(False)
        if opts.group is not None:
            ifindex = socket.if_nametoindex(opts.interface) if opts.interface else 0
            udp.multicast_from(sock, address=opts.listen[0], ifindex=ifindex)
        xdp = None
        mode = "userspace"
        if opts.mode in ("auto", "xdp"):
            try:
                from bpf.xdp import XdpAggregator

                xdp = XdpAggregator(layout, job=opts.job, port=opts.listen[1], expected=topology.gateway_mask(),
                                    timeout=opts.slot_timeout)
                assert opts.interface is not None
                attached = xdp.attach(socket.if_nametoindex(opts.interface))
                mode = f"xdp ({attached})"
            except (LoaderError, OSError) as exc:
                if xdp is not None:
                    xdp.close()
                    xdp = None
                if opts.mode == "xdp":
                    sock.close()
                    raise
                log.warning("edge: XDP unavailable (%s); aggregating in userspace", exc)
                self.fallback = str(exc)
        self._xdp = xdp
        self.mode = mode
        agent = EdgeAgent(sock, layout, workers=opts.workers, job=opts.job,
                          mode="xdp" if xdp is not None else "userspace", xdp=xdp, slot_timeout=opts.slot_timeout,
                          secret=opts.secret, group=opts.group, topology=topology, retransmit=opts.retransmit,
                          query_nacks=opts.query_nacks)
        if self._compression is not None:
            agent.gia_threshold = self._compression[0].gia_threshold
        agent.pace_gbit = self.paces()
        log.info("edge: gateway for %d LAN workers on %s:%d, %s aggregation, %d slots (%.1f MB), %s",
                 opts.workers, *opts.listen, mode, layout.num_slots, layout.map_bytes / 1e6,
                 "datagrams authenticated by tokens" if opts.secret else "no secret: datagrams not authenticated")
        if agent.pace_gbit:
            log.info("edge: workers paced to their planned rates (Gbit/s): %s",
                     ", ".join(f"{w}: {r:.4g}" for w, r in sorted(agent.pace_gbit.items())))
        return agent

    def _start_tcp(self, layout: EdgeLayout) -> TcpEdgeAgent:
        """The TCP path: workers stream to ``listen`` over TCP (the same port number as the UDP paths')."""
        opts = self.options
        if self._compression is not None:
            raise ConfigError("--edge-mode tcp carries dense gradients; a compressed job's LAN tier needs xdp or "
                              "userspace")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(opts.listen)
        self.mode = "tcp"
        log.info("edge: gateway for %d LAN workers on %s:%d, tcp aggregation, %s", opts.workers, *opts.listen,
                 "frames authenticated by tokens" if opts.secret else "no secret: frames not authenticated")
        return TcpEdgeAgent(sock, layout, workers=opts.workers, job=opts.job, secret=opts.secret)

    async def run(self) -> None:
        """Serve the LAN until cancelled (started by ``netstorm node`` beside the node)."""
        try:
            await self._started.wait()
            assert self.agent is not None
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.agent.run())
                tg.create_task(self._broadcast())
        finally:
            self._tg = None
            if self.agent is not None:
                self.agent.close()
                self.agent.sock.close()
            if self._xdp is not None:
                self._xdp.close()  # type: ignore[attr-defined]

    async def combine(self, iteration: int, key: int, values: np.ndarray | None,
                      sizes: list[int]) -> np.ndarray | None:
        """This DC's contribution of tensor ``key``: the gateway trainer's values plus the LAN sum."""
        await self._ensure_started(sizes)
        if self.init_iteration is None:
            self.init_iteration = iteration
        if iteration == self.init_iteration:
            return values
        if self._compression is not None:
            await self._wire(iteration)
        sums = await asyncio.shield(self._collect_task(iteration))
        if isinstance(sums, NetStormError):
            raise type(sums)(str(sums))   # fails this iteration's contribution, not the node
        lan = sums[key]
        return lan if values is None else np.asarray(values, np.float32) + lan

    async def combine_parts(self, iteration: int, key: int, values: np.ndarray | None, sizes: list[int],
                            parts: list[tuple[int, int]], hand: Callable[[int, np.ndarray], None]) -> None:
        """This DC's contribution of tensor ``key`` part by part (``parts``: ``(start, stop)`` elements, the
        node's ``Layout.key_parts``): ``hand(part, values)`` is called for each part, the gateway trainer's
        values plus the LAN sum there, as soon as every LAN chunk under it is summed, so the node's WAN step
        of that part starts while the LAN still sums the rest. The sums are exactly ``combine``'s. Returns
        once every part was handed; when the LAN sum fails (a worker missing past the timeout, an overflow,
        the iteration failed at the node), the parts not handed yet raise its typed error. On the TCP path a
        part is ready once every worker's DATA frames (512 LAN chunks each, in layout order) passed it. The
        first iteration and a compressed round's wires hand every part at once, after ``combine``."""
        await self._ensure_started(sizes)
        if self.init_iteration is None:
            self.init_iteration = iteration
        agent = self.agent
        if iteration == self.init_iteration or self._compression is not None or agent is None or len(parts) < 2:
            whole = await self.combine(iteration, key, values, sizes)
            for part, (start, stop) in enumerate(parts):
                hand(part, whole[start:stop] if whole is not None else np.zeros(stop - start, np.float32))
            return
        task = self._collect_task(iteration)
        watch = self._watch(iteration)
        wake = watch.waiters.setdefault(key, asyncio.Event())
        ready = watch.pending.setdefault(key, [])
        ready += watch.readiness.watch(key, parts)
        own = None if values is None else np.asarray(values, np.float32).reshape(-1)
        handed = 0
        while handed < len(parts):
            while ready:
                part = ready.pop(0)
                start, stop = parts[part]
                lan = watch.sums.part(key, start, stop)
                hand(part, lan if own is None else own[start:stop] + lan)
                handed += 1
                watch.handed += 1
                if watch.first_handed is None:
                    watch.first_handed = time.monotonic()
            if handed == len(parts):
                break
            if task.done():
                outcome = task.result()
                if isinstance(outcome, NetStormError):
                    raise type(outcome)(f"{outcome} ({handed} of tensor {key}'s {len(parts)} parts were handed to "
                                        f"the node before)")
                if not ready:
                    raise RuntimeError(f"edge: iteration {iteration} summed but tensor {key} has parts not ready")
                continue
            wake.clear()
            await wake.wait()

    async def _ensure_started(self, sizes: list[int]) -> None:
        async with self._starting:
            if self.agent is None:
                await self.wait_plan()
                # compiling and loading the XDP program takes seconds: keep the node's loop (heartbeats) free
                self.agent = await asyncio.to_thread(self._start, sizes)
                self._model_bytes = 4 * sum(sizes)
                self._started.set()
                if self.on_started is not None:
                    self.on_started(self.mode, self.fallback)

    def _collect_task(self, iteration: int) -> asyncio.Task[list[np.ndarray] | NetStormError]:
        """The task collecting ``iteration``'s LAN sums (started by the first tensor that asks)."""
        task = self._lan.get(iteration)
        if task is None:
            if self._tg is None:
                raise RuntimeError("edge: combine before GatewayRole.run started serving the LAN")
            task = self._tg.create_task(self._collect(iteration))
            self._lan[iteration] = task
            for old in [k for k in self._lan if k < iteration - 2]:
                del self._lan[old]
                self._watches.pop(old, None)
        return task

    def _watch(self, iteration: int) -> _PartWatch:
        """``iteration``'s parts readiness, fed by the agent's completion hook from now on (what completed
        before is taken from the sums' mask at once)."""
        watch = self._watches.get(iteration)
        if watch is not None:
            return watch
        agent = self.agent
        assert agent is not None
        agent.expect(iteration)
        holder: list[_PartWatch] = []

        def completed(seqs: np.ndarray) -> None:
            for tensor, part in holder[0].readiness.completed(seqs):
                holder[0].pending.setdefault(tensor, []).append(part)
                event = holder[0].waiters.get(tensor)
                if event is not None:
                    event.set()

        sums = agent.watch(iteration, completed)
        watch = _PartWatch(PartReadiness(sums.layout, ~sums.open), sums)
        holder.append(watch)
        self._watches[iteration] = watch

        def finished(_: asyncio.Task[list[np.ndarray] | NetStormError]) -> None:
            for event in watch.waiters.values():
                event.set()
        self._collect_task(iteration).add_done_callback(finished)
        return watch

    async def _collect(self, iteration: int) -> list[np.ndarray] | NetStormError:
        """The LAN sums, or why there are none: the timeout naming the missing workers, an integer overflow,
        or the node failed the iteration meanwhile (kept out of the role's TaskGroup)."""
        assert self.agent is not None
        asked = time.monotonic()
        try:
            sums = await self.agent.collect(iteration, timeout=self.iteration_timeout)
        except (EdgeTimeout, WireError, IterationAborted) as exc:
            log.error("edge: %s", exc)
            self.lan_failures += 1
            return exc
        self._count(iteration)
        self._log_phases(iteration, asked)
        self._measured(iteration)
        # a compressed round's sums cover its wire: the rest of every tensor is zeros
        return sums if self.rounds is None else self.rounds.contribution(iteration, sums)

    def _count(self, iteration: int) -> None:
        """Count one collected LAN sum for operators (``lan_*`` attributes, the node's metrics)."""
        assert self.agent is not None
        self.lan_iterations += 1
        nbytes = self._model_bytes * self.options.workers
        self.lan_bytes += nbytes
        summed = self.agent.summed_at(iteration)
        released = self._released_at.get(iteration - 1)
        if summed is not None and released is not None and summed[1] > released:
            self.lan_seconds += summed[1] - released
            self.lan_last_gbit = nbytes * 8 / (summed[1] - released) / 1e9

    def lan_losses(self) -> dict[str, int]:
        """Recoveries the LAN needed so far, by kind: NACK datagrams (each names missing workers' chunks),
        QUERY answers, NACKs to cluster aggregators; zeros on the TCP path, which loses nothing."""
        agent = self.agent
        return {"nack": int(getattr(agent, "nack_datagrams", 0)),
                "query_nack": int(getattr(agent, "query_nacks_sent", 0)),
                "cluster_nack": int(getattr(agent, "cluster_nacks_sent", 0))}

    def _log_phases(self, iteration: int, asked: float) -> None:
        """One line per iteration with the LAN phase's times, from which an iteration's time splits into the
        LAN's share and the WAN's: the result of the iteration before released -> first and last chunk of
        this one summed, and how long the node's first combine of it waited for the sum."""
        assert self.agent is not None
        summed = self.agent.summed_at(iteration)
        released = self._released_at.get(iteration - 1)
        if summed is None or released is None:
            return
        now = time.monotonic()
        watch = self._watches.get(iteration)
        parts = ("" if watch is None or watch.first_handed is None else
                 f"; its first part went to the WAN step {watch.first_handed - released:.3f} s after that release")
        log.info("edge: iteration %d: LAN first chunk summed %.3f s and last %.3f s after the previous result was "
                 "released; the node asked for the sum %.3f s after that release and waited %.3f s%s",
                 iteration, summed[0] - released, summed[1] - released, asked - released, now - asked, parts)

    def _measured(self, iteration: int) -> None:
        """Feed the iteration's uplink bursts and the downlink bursts workers reported since to the meter;
        report the measured LAN when it moved enough."""
        assert self.agent is not None
        bursts = [("up", burst) for burst in self.agent.uplink_bursts(iteration)]
        bursts += [("down", burst) for burst in self.agent.downlink_bursts()]
        if self.meter is None or self.schedule is None:
            return
        topology = self.options.topology if self.options.topology is not None else LanTopology(self.options.workers)
        believed = {w.index: w.up_gbit for w in self.meter.measured().workers}
        bounds = uplink_bounds(self.meter.spec, topology.clusters, self.paces(), believed)
        for direction, (worker, nbytes, first, last) in bursts:
            if worker < len(self.meter.spec.workers):   # a paced (or member-bound) uplink sample is censored
                self.meter.on_burst(worker, direction, nbytes, first, last,
                                    bounds.get(worker) if direction == "up" else None)
        measured = self.meter.measured()
        now = self.clock()
        if self.on_measured is not None and self.schedule.due(measured, now):
            self.schedule.sent(measured, now)
            log.info("edge: measured LAN (up, down Gbit/s) %s reported to the scheduler",
                     {w.index: (round(w.up_gbit, 4), round(w.down_gbit, 4)) for w in measured.workers})
            self.on_measured(measured)

    def released(self, iteration: int, per_key: list[np.ndarray], workers: int) -> None:
        """The iteration's result (one flat float32 array per tensor, the sum over ``workers`` workers) goes
        back to the LAN workers. A compressed job's next wire is planned here, before the result (which
        its workers answer with that iteration's datagrams) leaves."""
        self._released.append(iteration)
        self._switch(iteration)
        if self._compression is not None and self.agent is not None and not isinstance(self.agent, TcpEdgeAgent):
            if iteration == self.init_iteration:
                self._plan_rounds(iteration, workers)
            elif self.rounds is not None:
                per_key, following = self.rounds.released(iteration, per_key)
                self.agent.plan(iteration + 1, following.layout, integer=following.integer, back=following.back)
            self._wired.set()
            self._wired = asyncio.Event()
        self._released_at[iteration] = time.monotonic()
        for old in [k for k in self._released_at if k < iteration - 4]:
            del self._released_at[old]
        try:
            self._results.put_nowait((iteration, per_key, workers))
        except asyncio.QueueFull:
            log.error("edge: result broadcast of iteration %d dropped: the LAN is 4 iterations behind", iteration)

    def _switch(self, iteration: int) -> None:
        """A pending plan's deployment runs from ``iteration + 1`` (its result, about to leave, announces it)."""
        plan = self.pending
        if plan is None or not isinstance(self.agent, EdgeAgent):
            return
        topology = topology_from_plan(plan, self.options.workers)
        try:
            switch = self.agent.redeploy(topology, iteration)
        except ServicesMissing as exc:
            log.warning("%s (%s plan %d; looked at again at the next released result)", exc, plan.planner,
                        plan.version)
            return
        self.options = dataclasses.replace(self.options, topology=topology)
        self.plan = plan
        self.pending = None
        self._planned.set()
        self.agent.pace_gbit = self.paces()   # the workers' HELLOs of the new epoch take the new plan's rates
        log.info("edge: %s plan %d deployed from iteration %d (epoch %s): clusters %s; the aggregators and "
                 "unclustered workers %s send to the gateway", plan.planner, plan.version, iteration + 1,
                 switch.epoch if switch is not None else self.agent.epoch, dict(topology.clusters),
                 list(topology.unclustered))

    def failed(self, iteration: int) -> None:
        """The node failed ``iteration`` (its LAN sum did not come, or the WAN step failed): no result goes
        back. A compressed job's next wire restarts the rounds (``GatewayRounds.failed``), planned before
        the workers hear of the failure; then the agent tells them (``EdgeAgent.fail``), so each ends the
        iteration at once and sends the next one on that wire. Reported once per iteration; repeats and
        iterations before the LAN tier's first summed one are ignored."""
        if self.agent is None or self.init_iteration is None or iteration <= self.init_iteration:
            return
        if isinstance(self.agent, TcpEdgeAgent):
            return   # the TCP path has no FAILED notice: its workers end a failed iteration at their timeout
        if iteration in self.agent.failed or iteration in self._released:
            return
        if self._compression is not None and self.rounds is not None:
            following = self.rounds.failed(iteration)
            if following is not None:
                self.agent.plan(iteration + 1, following.layout, integer=following.integer, back=following.back)
                self._wired.set()
                self._wired = asyncio.Event()
        log.warning("edge: iteration %d failed at the node; the LAN workers are told and go on with %d",
                    iteration, iteration + 1)
        self.agent.fail(iteration)

    async def _broadcast(self) -> None:
        assert self.agent is not None
        while True:
            iteration, per_key, workers = await self._results.get()
            try:
                first = iteration == self.init_iteration
                if first:
                    await self.agent.wait_workers(self.iteration_timeout)
                await self.agent.send_results(iteration, per_key, total=workers, unicast=first)
            except EdgeTimeout as exc:   # a worker that never said HELLO: the others still get results
                log.error("edge: results of iteration %d: %s", iteration, exc)
            except WireError as exc:     # a result its planned form cannot carry: the workers' timeout names it
                log.error("edge: results of iteration %d not sent: %s", iteration, exc)
