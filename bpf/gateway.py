"""The gateway role of a general node: its LAN workers' sum joins the DC's contribution, and the WAN result
goes back to them. ``GatewayRole`` coordinates: the agent is started on its path by bpf/agentstart.py,
the node takes an iteration part by part through bpf/parthandout.py, the scheduler's plans are taken as
netstorm/lan/planintake.py decides, and netstorm/lan/tiermeasures.py counts and measures the LAN tier.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from bpf.agent import EdgeAgent
from bpf.agentstart import start_agent
from bpf.edgeoptions import EdgeOptions
from bpf.parthandout import Collection, PartHandout
from bpf.tcpagent import TcpEdgeAgent
from bpf.xdp import XdpAggregator
from netstorm.compression.options import CompressionOptions
from netstorm.control import LanPlan, LanReport
from netstorm.errors import NetStormError
from netstorm.lan import planintake, tiermeasures
from netstorm.lan.deploy import LanTopology
from netstorm.lan.errors import EdgeTimeout, IterationAborted, ServicesMissing, WireError
from netstorm.lan.introunds import GatewayRounds, Wire
from netstorm.lan.planintake import topology_from_plan
from netstorm.lan_scenario import LanSpec
from netstorm.lanreport import report_from_spec
from netstorm.layout import Layout

__all__ = ["EdgeOptions", "GatewayRole", "topology_from_plan"]

log = logging.getLogger("netstorm.edge")


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
        self._xdp: XdpAggregator | None = None
        self._started = asyncio.Event()
        self._starting = asyncio.Lock()
        self._lan: dict[int, Collection] = {}
        self._handouts: dict[int, PartHandout] = {}
        """Iterations whose tensors are handed to the node part by part (``combine_parts``)."""
        self._results: asyncio.Queue[tuple[int, list[np.ndarray], int]] = asyncio.Queue(maxsize=4)
        self._tg: asyncio.TaskGroup | None = None
        self.plan: LanPlan | None = None
        """The scheduler's plan the running (or next) deployment follows."""
        self.pending: LanPlan | None = None
        """A newer plan with another deployment, received once the LAN tier ran: it runs from the iteration after
        the next released result (``_switch``)."""
        self._planned = asyncio.Event()
        self.measures = tiermeasures.LanMeasures(options.lan, change=options.report_change,
                                                 interval=options.report_interval)
        """The LAN tier's counters (the ``lan_*`` properties), phase log and measured rates."""
        self.meter = self.measures.meter
        """Each worker's achieved rates, from the data the gateway receives (netstorm/lanreport.py)."""
        self.on_measured: Callable[[LanSpec], None] | None = None
        """Called with the measured LAN when it moved enough to tell the scheduler (the node sends it as a
        ``LanReport``, measured)."""
        self.clock: Callable[[], float] = time.monotonic
        self._compression: tuple[Layout, CompressionOptions] | None = None
        self.rounds: GatewayRounds | None = None
        """A compressed job's wires, one per iteration (planned as each result is released)."""
        self._wired = asyncio.Event()
        self._model_bytes = 0
        self._released: deque[int] = deque(maxlen=8)
        """The newest iterations whose results went back: a failure reported for one of them is ignored
        (its workers have, or can PULL, the result)."""

    @property
    def lan_iterations(self) -> int:
        """Iterations whose LAN sums this gateway collected."""
        return self.measures.lan_iterations

    @property
    def lan_failures(self) -> int:
        """Iterations whose LAN sum failed (a timeout naming missing workers, an overflow, an abort)."""
        return self.measures.lan_failures

    @property
    def lan_bytes(self) -> int:
        """Bytes of float32 gradients the LAN summed: the model's size times the workers, per iteration."""
        return self.measures.lan_bytes

    @property
    def lan_seconds(self) -> float:
        """Seconds of the LAN phases: from the previous result's release to the last chunk summed."""
        return self.measures.lan_seconds

    @property
    def lan_last_gbit(self) -> float:
        """The newest LAN phase's throughput (its bytes over its seconds), Gbit/s; 0 before one."""
        return self.measures.lan_last_gbit

    def lan_losses(self) -> dict[str, int]:
        """Recoveries the LAN needed so far, by kind (``tiermeasures.lan_losses``)."""
        return tiermeasures.lan_losses(self.agent)

    def announce(self, node_id: int, t: float = 0.0) -> LanReport | None:
        """The ``LanReport`` describing this gateway's LAN (None without a description)."""
        if self.options.lan is None:
            return None
        return report_from_spec(node_id, self.options.lan, t=t)

    def apply_lan_plan(self, plan: LanPlan) -> None:
        """Take the scheduler's plan of this LAN, as netstorm/lan/planintake.py decides: its two-level form is
        the deployment if the LAN tier has not started, else a changed one waits as ``pending`` for the next
        released result (``_switch``)."""
        taken = planintake.intake(plan, self.plan, workers=self.options.workers, one_level=self.options.mode == "tcp",
                                  running=self.agent is not None, current=self._topology())
        if taken is None:
            return
        if taken.now:
            self._follow(plan, taken.topology if self.agent is None else None)
        else:
            self.pending = plan

    def _follow(self, plan: LanPlan, topology: LanTopology | None) -> None:
        """Follow ``plan`` from now on; ``topology``: its deployment, replacing the configured one (None: the
        one deployed is the plan's)."""
        if topology is not None:
            self.options = dataclasses.replace(self.options, topology=topology)
        self.plan = plan
        self.pending = None
        self._planned.set()
        if isinstance(self.agent, EdgeAgent):   # new rates reach the workers that say HELLO from now on
            self.agent.pace_gbit = self.paces()

    def paces(self) -> dict[int, float]:
        """Per worker, the Gbit/s its HELLO answer tells it to pace to: the plan's rate x ``rate_scale``
        with ``pace_rates``, else none."""
        return planintake.paces(self.plan, pace_rates=self.options.pace_rates, rate_scale=self.options.rate_scale)

    def _topology(self) -> LanTopology:
        """The deployment the LAN tier runs (or starts with)."""
        return self.options.topology if self.options.topology is not None else LanTopology(self.options.workers)

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
        """The agent on the path the options name (bpf/agentstart.py); the workers' paces are read once it
        is made (a plan may arrive while XDP loads)."""
        started = start_agent(self.options, sizes, paces=self.paces,
                              compressed=None if self._compression is None else self._compression[0])
        self.mode, self.fallback, self._xdp = started.mode, started.fallback, started.xdp
        return started.agent

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
                self._xdp.close()

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
        await self._handout(iteration).hand(key, values, parts, hand)

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

    def _collect_task(self, iteration: int) -> Collection:
        """The task collecting ``iteration``'s LAN sums (started by the first tensor that asks)."""
        task = self._lan.get(iteration)
        if task is None:
            if self._tg is None:
                raise RuntimeError("edge: combine before GatewayRole.run started serving the LAN")
            task = self._tg.create_task(self._collect(iteration))
            self._lan[iteration] = task
            for old in [k for k in self._lan if k < iteration - 2]:
                del self._lan[old]
                self._handouts.pop(old, None)
        return task

    def _handout(self, iteration: int) -> PartHandout:
        """``iteration``'s parts for the node, watched from the first tensor that asks (bpf/parthandout.py)."""
        handout = self._handouts.get(iteration)
        if handout is None:
            assert self.agent is not None
            handout = PartHandout(self.agent, iteration, self._collect_task(iteration))
            self._handouts[iteration] = handout
        return handout

    async def _collect(self, iteration: int) -> list[np.ndarray] | NetStormError:
        """The LAN sums, or why there are none: the timeout naming the missing workers, an integer overflow,
        or the node failed the iteration meanwhile (kept out of the role's TaskGroup)."""
        assert self.agent is not None
        asked = time.monotonic()
        try:
            sums = await self.agent.collect(iteration, timeout=self.iteration_timeout)
        except (EdgeTimeout, WireError, IterationAborted) as exc:
            log.error("edge: %s", exc)
            self.measures.failed()
            return exc
        handout = self._handouts.get(iteration)
        self.measures.collected(iteration, self._model_bytes * self.options.workers, self.agent.summed_at(iteration),
                                asked=asked, now=time.monotonic(),
                                first_handed=None if handout is None else handout.watch.first_handed)
        self._measured(iteration)
        # a compressed round's sums cover its wire: the rest of every tensor is zeros
        return sums if self.rounds is None else self.rounds.contribution(iteration, sums)

    def _measured(self, iteration: int) -> None:
        """Feed the iteration's uplink bursts and the downlink bursts workers reported since to the meter;
        report the measured LAN when it moved enough."""
        assert self.agent is not None
        bursts: list[tiermeasures.Burst] = [("up", burst) for burst in self.agent.uplink_bursts(iteration)]
        bursts += [("down", burst) for burst in self.agent.downlink_bursts()]
        measured = self.measures.measured(bursts, self._topology().clusters, self.paces(), self.clock(),
                                          reporting=self.on_measured is not None)
        if measured is not None and self.on_measured is not None:
            self.on_measured(measured)

    def released(self, iteration: int, per_key: list[np.ndarray], workers: int) -> None:
        """The iteration's result (one flat float32 array per tensor, the sum over ``workers`` workers) goes
        back to the LAN workers. A compressed job's next wire is planned here, before the result (which
        its workers answer with that iteration's datagrams) leaves."""
        self._released.append(iteration)
        self._switch(iteration)
        agent = self.agent
        if self._compression is not None and agent is not None and not isinstance(agent, TcpEdgeAgent):
            if iteration == self.init_iteration:   # the first summed iteration's wire
                layout, options = self._compression
                self.rounds = GatewayRounds.of_layout(layout, options, lanes=agent.layout.lanes,
                                                      pool=agent.layout.num_slots, scale=self.options.scale,
                                                      contributors=workers, first_iteration=iteration + 1)
                self._plan_wire(iteration, self.rounds.wire_of(iteration + 1))
            elif self.rounds is not None:
                per_key, following = self.rounds.released(iteration, per_key)
                self._plan_wire(iteration, following)
        self.measures.released(iteration, time.monotonic())
        try:
            self._results.put_nowait((iteration, per_key, workers))
        except asyncio.QueueFull:
            log.error("edge: result broadcast of iteration %d dropped: the LAN is 4 iterations behind", iteration)

    def _plan_wire(self, iteration: int, wire: Wire) -> None:
        """``iteration + 1`` runs on ``wire``: the agent is told, and ``_wire``'s waiters are woken."""
        assert self.agent is not None and not isinstance(self.agent, TcpEdgeAgent)
        self.agent.plan(iteration + 1, wire.layout, integer=wire.integer, back=wire.back)
        self._wired.set()
        self._wired = asyncio.Event()

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
        self._follow(plan, topology)   # the workers' HELLOs of the new epoch take the new plan's rates
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
                self._plan_wire(iteration, following)
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
