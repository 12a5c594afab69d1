"""The scheduler's asyncio shell: control TCP, SNTP on the same port, heartbeat timer, re-planning.

Protocol decisions live in the sans-I/O cores (membership.py, consistency.py, replan.py); with
``state_dir`` set, every decision a node may already rely on (members, policy versions, bindings, the
layout) is written to ``persistence.StateStore`` before it is answered, and a scheduler started again
with the same command line resumes from it: nodes re-attach and bound iterations keep their versions.
This module
moves frames, runs the timers and carries out the re-plan core's actions, handing planning to a thread
(asyncio.to_thread) so a slow plan never delays a heartbeat or a policy reply. Each connection is
served by one task that answers every request before reading the next, so replies come back in request
order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection

from netstorm import auth, authconn, bulkprobe, control
from netstorm.authconn import Credentials
from netstorm.clock import serve_sntp
from netstorm.config import LOCAL, Config
from netstorm.errors import AuthError, ConfigError, ErrorCode
from netstorm.planning.offload import plan_offload
from netstorm.policy import Policy
from netstorm.scenario import Rates
from scheduler.cadence import Cadence
from scheduler.collector import LinkCollector
from scheduler.consistency import Answer, Consistency, ConsistencyError
from scheduler.iterlog import IterationLog
from scheduler.lanplanning import LanPlanning
from scheduler.layoutvote import LayoutVote
from scheduler.membership import Down, Membership, MembershipError
from scheduler.persistence import StateStore
from scheduler.planner import Planner, PlanningError, restrict
from scheduler.proberound import ProbeRound
from scheduler.replan import Action, Log, Plan, PlanMoves, Publish, PushBeliefs, Replanner

log = logging.getLogger(__name__)

STATUS_BINDINGS = 64
"""Most recent iteration -> version bindings a status answer carries."""
HISTORY_BINDINGS = 1024
"""Bindings one history answer carries at most (a page)."""
HISTORY_POLICIES = 16
"""Published policy versions one history answer carries at most (a page)."""
POLICY_RECORDS = 256
"""Published policy versions the history remembers (roots, trees and why each was planned)."""
SEND_TIMEOUT = 10.0
"""Seconds a reply may wait for a peer's socket to drain before that peer is dropped."""
PROBE_LINK_S = 30.0
"""Seconds one link's first probe may take."""
STOP_GRACE_S = 1.0
"""Seconds a stopping scheduler waits for its closed connections' handlers to end before cancelling them."""


class _Connection:
    """One peer's control connection: serialized writes with a deadline."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = control.format_address(peer[:2]) if isinstance(peer, tuple) else str(peer)
        self.node_id: int | None = None
        self.proven: auth.Identity | None = None
        """Who the connection proved to be (with a job secret; None without one)."""
        self.leaving: str | None = None
        """Why the node said it leaves (``Leave``), before it closed the connection."""
        self._lock = asyncio.Lock()

    def name(self) -> str:
        return f"node {self.node_id} ({self.peer})" if self.node_id is not None else self.peer

    async def send(self, message: control.Message) -> None:
        async with self._lock:
            if self.writer.is_closing():
                raise ConnectionError(f"connection to {self.name()} is closed")
            self.writer.write(control.encode(message))
            try:
                async with asyncio.timeout(SEND_TIMEOUT):
                    await self.writer.drain()
            except TimeoutError:
                raise ConnectionError(f"{self.name()} did not read its control messages for {SEND_TIMEOUT} s") \
                    from None

    def close(self) -> None:
        self.writer.close()


class SchedulerService:
    """State of one job's scheduler; ``serve`` runs it until cancelled."""

    def __init__(self, rates: Rates, nodes: Collection[int], config: Config, *, topology: str = "fapt",
                 num_roots: int | None = None, clock: Callable[[], float] = time.time,
                 credentials: Credentials | None = None, unknown: Collection[tuple[int, int]] = (),
                 probe_bytes: int = bulkprobe.DEFAULT_BYTES, probe_deadline: float | None = None) -> None:
        self.config = config
        self.unknown = frozenset(unknown)
        """Directed links the scenario gives no rate for: probed by their nodes before the first policy."""
        self.probe_bytes = probe_bytes
        self.probe_deadline = probe_deadline
        """Seconds the first probe round may take in all (None: each node's links in turn, PROBE_LINK_S each)."""
        self.probing: ProbeRound | None = None
        """The first probe round, while it runs and after (what it measured)."""
        self._probed = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None
        self._sinks: dict[int, int] = {}
        """Node -> the port of its probe sink (from its Register; 0: none)."""
        self.credentials = credentials
        """With a job secret, every control connection proves who it is before it is read."""
        self.initial_rates = dict(rates)
        self.clock = clock
        self.membership = Membership(nodes, heartbeat_timeout=config.heartbeat_timeout,
                                     allow_joiners=config.allow_joiners)
        if len(self.membership.expected) < 2 or not restrict(rates, nodes):
            raise ConfigError(f"a job needs at least two DCs joined by overlay links, got nodes "
                              f"{list(self.membership.expected)}")
        self.consistency = Consistency()
        self.planner = Planner.from_config(config, topology=topology, num_roots=num_roots)
        self.replanner = Replanner(config, rates, nodes, planner=self.planner, consistency=self.consistency,
                                   now=clock())
        try:  # fail at startup, not when the last node registers, if these nodes cannot form a job
            probe = Planner(topology=topology, num_roots=self.planner.num_roots, update_rate=0.0,
                            relative_change=LinkCollector.relative_change, packing=config.tree_packing)
            probe.first(rates, self.membership.expected)
        except PlanningError as exc:
            raise ConfigError(str(exc)) from None
        self.address: tuple[str, int] | None = None
        self._connections: dict[int, _Connection] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        """Connection handler tasks (asyncio.start_server starts them); serve ends them before it returns."""
        self._stopping = False
        """Set when ``serve`` ends: closing connections are then no member going down."""
        self._plan_lock = asyncio.Lock()
        """Held from a ``Plan`` action's making to its results' publication: one plan at a time, each
        against the policy current when it was made."""
        self._replan_wake = asyncio.Event()
        """Set when the re-plan core's deadline may have moved earlier (a member down, a report)."""
        self._layout: tuple[str, int] | None = None
        self._votes: LayoutVote | None = None
        """The DCs' votes for the job's layout until a majority agrees (``scheduler.layoutvote``)."""
        self._edge: dict[int, tuple[str, str]] = {}
        self._vacancies: dict[int, control.Vacancy] = {}
        """Node -> its newest word that its trainer place is empty, until taken again: told to members that
        register or re-attach later, so that they too ask it for its part."""
        self.lan = LanPlanning(config)
        """Plans of each DC's LAN tier (``dc_planner``), from its gateway's LAN reports."""
        self._lan_wake = asyncio.Event()
        """Gateway node -> (LAN aggregation mode, why XDP fell back), from its EdgeReport."""
        self._published: collections.deque[control.PolicyRecord] = collections.deque(maxlen=POLICY_RECORDS)
        self._planned_rates: collections.OrderedDict[int, dict[tuple[int, int], float]] = collections.OrderedDict()
        """Published version -> the rates it was planned with (the newest POLICY_RECORDS)."""
        self.iterations = IterationLog(self._planned_rates.get)
        """The iteration times nodes report in their heartbeats, against each one's min-cut limit."""
        self.publications = 0
        """Policy versions published by this process (the first plan, re-plans, admissions, overrides)."""
        self.errors: collections.Counter[str] = collections.Counter()
        """Errors by type, for operators: bad or unauthenticated control input, failed connections and plans."""
        self.complete = asyncio.Event()
        """Set once every node registered, the first policy exists and every RegisterAck went out."""
        self._admitting: set[int] = set()
        """DCs admitted whose policy is being planned: the next publication names them as joining."""
        self.store: StateStore | None = None
        self.resumed = False
        """This scheduler resumed a job from ``state_dir``."""
        if config.state_dir:
            self.store = StateStore.open(config.state_dir, {
                "nodes": list(self.membership.expected), "topology": topology, "roots": self.planner.num_roots,
                "rates": sorted([a, b, r] for (a, b), r in rates.items()), "joiners": config.allow_joiners})
            self._resume(self.store)

    def _resume(self, store: StateStore) -> None:
        """Take up the persisted job: its members, versions, bindings and layout."""
        saved = store.load()
        if saved.empty:
            return
        policies = [Policy.from_wire(wire) for _, wire, _ in saved.policies]
        self.consistency.restore(policies, saved.bindings, saved.joining)
        for policy, (_, _, reason) in zip(policies, saved.policies, strict=True):
            self._record(policy, reason)
        if policies:
            self.planner.roots = tuple(policies[0].roots)
            self.planner.planned_rates = dict(policies[-1].rates)
        self.membership.restore(saved.members, complete=saved.complete and bool(policies), now=self.clock())
        self._layout = saved.layout
        if self.config.layout_hash and saved.layout is not None and saved.layout[0] != self.config.layout_hash:
            raise ConfigError(f"the job in {store.path} runs layout {saved.layout[0]}, but layout_hash is "
                              f"{self.config.layout_hash}: start a new job (another state_dir) for another model")
        if self.membership.complete:
            self.complete.set()
        self.resumed = True
        log.info("resumed the job from %s: members %s (dead %s), policy version %s, iterations bound up to %d",
                 store.path, list(self.membership.alive), sorted(self.membership.dead),
                 self.consistency.current_version, self.consistency.last_bound)

    def _save_members(self) -> None:
        if self.store is not None:
            self.store.save_members(self.membership.rows())

    @property
    def collector(self) -> LinkCollector:
        """The link beliefs (the re-plan core's)."""
        return self.replanner.collector

    @collector.setter
    def collector(self, collector: LinkCollector) -> None:
        self.replanner.collector = collector

    @property
    def cadence(self) -> Cadence:
        return self.replanner.cadence

    @property
    def cycles(self) -> int:
        """Re-plan cycles run so far (tests wait on it instead of sleeping)."""
        return self.replanner.cycles

    # --- lifecycle -------------------------------------------------------------------------------

    async def serve(self, host: str, port: int, *, ready: Callable[[tuple[str, int]], None] | None = None) -> None:
        """Serve control TCP and SNTP on host:port until cancelled."""
        server, sntp, address = await self._bind(host, port)
        log.info("scheduler listening on %s (TCP control, UDP SNTP); expecting nodes %s",
                 control.format_address(address), list(self.membership.expected))
        try:
            async with server, asyncio.TaskGroup() as tasks:
                tasks.create_task(self._liveness_loop())
                tasks.create_task(self._replan_loop())
                tasks.create_task(self._lan_loop())
                if ready is not None:
                    ready(address)
                await server.serve_forever()
        finally:
            self._stopping = True
            if self._probe_task is not None:
                self._probe_task.cancel()
                await asyncio.gather(self._probe_task, return_exceptions=True)
            sntp.close()
            if self.store is not None:
                self.store.close()
            for conn in list(self._connections.values()):
                conn.close()
            # A closed connection ends its handler at end of stream; only a handler that does not is
            # cancelled (and then returns quietly: Python 3.11's stream protocol logs a cancelled
            # connection handler as an "Exception in callback").
            handlers = list(self._handlers)
            if handlers:
                _, pending = await asyncio.wait(handlers, timeout=STOP_GRACE_S)
                for handler in pending:
                    handler.cancel()
                await asyncio.gather(*handlers, return_exceptions=True)

    async def _bind(self, host: str, port: int) -> tuple[asyncio.Server, asyncio.DatagramTransport, tuple[str, int]]:
        """TCP and UDP on one port; with port 0, retry until a port is free for both."""
        for attempt in range(20):
            try:
                context = self.credentials.server_ssl() if self.credentials is not None else None
                server = await asyncio.start_server(self._serve_connection, host, port, ssl=context,
                                                    ssl_handshake_timeout=self.config.connect_timeout if context
                                                    else None)
            except OSError as exc:
                raise ConfigError(f"cannot listen on TCP {control.format_address((host, port))}: {exc}") from None
            sockname = server.sockets[0].getsockname()
            address = (str(sockname[0]), int(sockname[1]))
            try:
                sntp = await serve_sntp(address[0], address[1], self.clock)
            except OSError as exc:
                server.close()
                await server.wait_closed()
                if port != 0 or attempt == 19:
                    raise ConfigError(f"cannot serve SNTP on UDP {control.format_address(address)}: {exc}") from None
                continue
            self.address = address
            return server, sntp, address
        raise AssertionError("unreachable")

    # --- connections -----------------------------------------------------------------------------

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        conn = _Connection(writer)
        try:
            if self.credentials is not None and not await self._authenticate(conn, reader):
                return
            while True:
                # Every state has a deadline: a registered node heartbeats far more often than
                # idle_timeout; anything else (an admin tool, a node yet to register) must say what it
                # wants within connect_timeout of connecting or of its last answer.
                timeout = self.config.idle_timeout if conn.node_id is not None else self.config.connect_timeout
                try:
                    async with asyncio.timeout(timeout):
                        message = await control.read_message(reader, inbound=control.TO_SCHEDULER)
                except TimeoutError:
                    log.warning("%s sent nothing for %s s: closing", conn.name(), timeout)
                    with contextlib.suppress(ConnectionError):
                        await conn.send(control.Error(f"closing the connection: nothing received for {timeout:g} s",
                                                      ErrorCode.TIMEOUT))
                    break
                if message is None:
                    break
                if not await self._dispatch(conn, message):
                    break
        except control.ControlError as exc:
            log.warning("bad control input from %s: %s", conn.name(), exc)
            code = ErrorCode.AUTH if isinstance(exc, AuthError) else ErrorCode.MALFORMED
            self.errors["auth" if code is ErrorCode.AUTH else "malformed_control"] += 1
            with contextlib.suppress(ConnectionError):
                await conn.send(control.Error(f"bad control message: {exc}", code))
                # The sender may still be writing the refused frame: read and drop what it sends for a
                # moment, so it reads the refusal instead of a reset (its frame is never kept).
                await authconn.linger(reader, conn.writer)
        except ConnectionError as exc:
            log.warning("control connection to %s failed: %s", conn.name(), exc)
            self.errors["control_connection"] += 1
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        finally:
            conn.close()
            if conn.node_id is not None and self._connections.get(conn.node_id) is conn:
                del self._connections[conn.node_id]
                down = None if self._stopping else self.membership.disconnected(conn.node_id, self.clock(),
                                                                                 leaving=conn.leaving)
                self._save_members()
                if down is not None:
                    await self._member_down(down)

    async def _authenticate(self, conn: _Connection, reader: asyncio.StreamReader) -> bool:
        """Run the membership handshake first: a node proves its id, a tool proves it is the admin."""
        assert self.credentials is not None
        try:
            conn.proven = await authconn.server_stream(
                self.credentials, reader, conn.writer, plane=auth.Plane.CONTROL, me=auth.SCHEDULER,
                timeout=self.config.connect_timeout, allowed=(auth.Role.NODE, auth.Role.ADMIN),
                refuse=lambda why: control.encode(control.Error(why, ErrorCode.AUTH)))
        except AuthError as exc:
            log.warning("control connection from %s refused: %s", conn.peer, exc)
            return False
        return True

    def _unproven(self, conn: _Connection, what: str, role: auth.Role, node_id: int | None = None) -> str | None:
        """Why ``conn`` may not send ``what`` (None when it may): with a job secret, only a connection
        proven as ``role`` (and as node ``node_id``) may."""
        if self.credentials is None:
            return None
        wanted = auth.Identity(role, node_id or 0)
        if conn.proven != wanted:
            return (f"{what} needs a connection authenticated as {wanted}; this one is "
                    f"{conn.proven if conn.proven is not None else 'unauthenticated'}")
        return None

    async def _dispatch(self, conn: _Connection, message: control.Message) -> bool:
        """Handle one message; False closes the connection."""
        admin = isinstance(message, control.PolicyOverride | control.StatusRequest | control.PolicyFetch
                           | control.HistoryRequest)
        problem = self._unproven(conn, message.TYPE, auth.Role.ADMIN) if admin else None
        if isinstance(message, control.Register):
            problem = self._unproven(conn, f"registration as node {message.node_id}", auth.Role.NODE, message.node_id)
        if problem is not None:
            log.warning("%s refused: %s", conn.name(), problem)
            await conn.send(control.Error(problem, ErrorCode.AUTH))
            return False
        match message:
            case control.Register():
                return await self._register(conn, message)
            case control.Heartbeat():
                return await self._heartbeat(conn, message)
            case control.Leave():
                if conn.node_id is None or message.node_id != conn.node_id:
                    log.warning("leave for node %d from %s ignored: not that node's connection", message.node_id,
                                conn.name())
                    return True
                conn.leaving = message.reason
                log.info("node %d leaves: %s", message.node_id, message.reason)
                return False
            case control.PeerUnreachable():
                await self._peer_unreachable(conn, message)
            case control.IterationLost():
                if conn.node_id is None or message.node_id != conn.node_id:
                    log.warning("iteration lost of node %d from %s ignored: not that node's connection",
                                message.node_id, conn.name())
                    return True
                log.warning("node %d lost its part of iteration %d: %s", message.node_id, message.iteration,
                            message.reason)
                await self._broadcast(message, skip=message.node_id)
            case control.Vacancy():
                if conn.node_id is None or message.node_id != conn.node_id:
                    log.warning("vacancy of node %d from %s ignored: not that node's connection", message.node_id,
                                conn.name())
                    return True
                log.warning("node %d's trainer place is %s from iteration %d%s", message.node_id,
                            "taken again" if message.filled else "empty", message.iteration,
                            f": {message.reason}" if message.reason else "")
                if message.filled:
                    self._vacancies.pop(message.node_id, None)
                else:
                    self._vacancies[message.node_id] = message
                await self._broadcast(message, skip=message.node_id)
            case control.PartWanted():
                peer = self._connections.get(message.peer)
                if conn.node_id is None or message.node_id != conn.node_id or peer is None:
                    log.warning("part of iteration %d wanted by node %d of node %d from %s ignored: not that node's "
                                "connection, or no connection to node %d", message.iteration, message.node_id,
                                message.peer, conn.name(), message.peer)
                    return True
                try:
                    await peer.send(message)
                except ConnectionError as exc:  # it is going away; its own handler reports that
                    log.info("could not send %s to %s: %s", message.TYPE, peer.name(), exc)
            case control.PolicyRequest():
                await self._policy_request(conn, message)
            case control.LayoutCheck():
                await self._layout_check(conn, message)
            case control.LinkReport():
                self._link_report(conn, message)
            case control.EdgeReport():
                self._edge_report(conn, message)
            case control.LanReport():
                self._lan_report(conn, message)
            case control.ProbeResult():
                self._probe_result(conn, message)
            case control.PolicyOverride():
                await self._override(conn, message)
            case control.StatusRequest():
                await conn.send(self.status())
            case control.PolicyFetch():
                await conn.send(self._policy_fetch(message.version))
            case control.HistoryRequest():
                await conn.send(self.history(message.since_iteration, message.since_version))
            case _:
                await conn.send(control.Error(f"the scheduler does not accept {message.TYPE} messages"))
        return True

    def _member(self, conn: _Connection, claimed: int, what: str) -> str | None:
        """Why ``conn`` may not act for node ``claimed`` (None when it may)."""
        if conn.node_id is None:
            return f"{what} from an unregistered connection ({conn.peer})"
        if claimed != conn.node_id:
            return f"{what} names node {claimed} but this connection registered as node {conn.node_id}"
        return None

    async def _register(self, conn: _Connection, message: control.Register) -> bool:
        if conn.node_id is not None:
            await conn.send(control.Error(f"this connection already registered as node {conn.node_id}"))
            return True
        if self.membership.complete:
            return await self._register_running(conn, message)
        try:
            completes = self.membership.register(message.node_id, (message.data_host, message.data_port),
                                                 self.clock(), workers=message.workers)
        except MembershipError as exc:
            log.warning("registration from %s refused: %s", conn.peer, exc)
            await conn.send(control.Error(str(exc), ErrorCode.NOT_MEMBER))
            return False
        conn.node_id = message.node_id
        self._connections[message.node_id] = conn
        self._sinks[message.node_id] = message.probe_port
        log.info("node %d registered from %s with data address %s:%d, %d worker(s) (%d of %d)", message.node_id,
                 conn.peer, message.data_host, message.data_port, message.workers, len(self.membership.registered),
                 len(self.membership.expected))
        if completes:
            if self.unknown and not self.resumed:
                await self._start_probe()
            else:
                await self._start_job()
        return True

    async def _start_probe(self) -> None:
        """Every node is here and some links have no rate: have their nodes measure them, and plan the
        first policy when every result came or the deadline passed (``_probe_phase``). Heartbeats and
        every other message are served meanwhile."""
        members = self.membership.members()
        per_node = collections.Counter(src for src, dst in self.unknown if src in members and dst in members)
        deadline = self.probe_deadline if self.probe_deadline is not None \
            else PROBE_LINK_S * max(per_node.values(), default=1) + self.config.connect_timeout
        self.probing = probing = ProbeRound(
            self.unknown, self.initial_rates, members=members, sinks=self._sinks, nbytes=self.probe_bytes,
            timeout_s=PROBE_LINK_S, heartbeat_s=self.config.heartbeat_interval, now=self.clock(),
            deadline_s=deadline)
        if probing.skipped:
            log.warning("links %s have no rate and an end without a probe sink: they start from the prior",
                        [f"{a}->{b}" for a, b in probing.skipped])
        log.info("probing %d link(s) with no rate before the first policy (%d bytes each, at most %g s)",
                 len(probing.links), self.probe_bytes, deadline)
        for node_id, request in probing.requests.items():
            conn = self._connections.get(node_id)
            try:
                if conn is None:
                    raise ConnectionError("no control connection")
                await conn.send(request)
            except ConnectionError as exc:
                log.warning("cannot ask node %d to probe: %s", node_id, exc)
                probing.gone(node_id)
        if probing.done:
            self._probed.set()
        self._probe_task = asyncio.create_task(self._probe_phase(probing, deadline), name="first-probe")

    async def _probe_phase(self, probing: ProbeRound, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline):
                await self._probed.wait()
        for (src, dst), why in sorted(probing.failed.items()):
            log.warning("probe of link %d->%d failed: %s", src, dst, why)
        measured = " ".join(f"{a}>{b}:{mbit:.1f}" for (a, b), mbit in sorted(probing.measured.items()))
        log.info("first probe measured %d of %d link(s) with no rate (Mbit/s %s)", len(probing.measured),
                 len(self.unknown), measured or "none")
        if probing.missing:
            log.warning("%s: link(s) %s start from the prior", "probe deadline passed" if not probing.done
                        else "not measured", [f"{a}->{b}" for a, b in probing.missing])
        probing.end(self.clock())
        self.replanner.probed(probing.measured, self.clock())
        await self._start_job()

    def _probe_result(self, conn: _Connection, message: control.ProbeResult) -> None:
        problem = self._member(conn, message.node_id, "probe result")
        if problem is None and (self.probing is None or self._probed.is_set()):
            problem = f"probe result from node {message.node_id} outside the first probe round"
        if problem is not None:
            log.warning("%s: ignored", problem)
            return
        assert self.probing is not None
        for why in self.probing.result(message):
            log.warning("probe result of node %d: %s: ignored", message.node_id, why)
        if self.probing.done:
            self._probed.set()

    async def _register_running(self, conn: _Connection, message: control.Register) -> bool:
        """A registration into the running job: a node re-attaching (``attach``), or a new process (a
        restarted DC, or a joiner) that waits for admission at its trainer's layout check."""
        node_id = message.node_id
        existing = self._connections.get(node_id)
        try:
            if message.attach:
                self.membership.attach(node_id, self.clock())
            elif existing is not None and not existing.writer.is_closing():
                raise MembershipError(f"duplicate node id {node_id}: connected from {existing.peer}")
            else:
                prior = self.membership.rejoin(node_id, (message.data_host, message.data_port), self.clock(),
                                               workers=message.workers)
                if prior is not None:
                    await self._member_down(prior)
        except MembershipError as exc:
            log.warning("registration from %s refused: %s", conn.peer, exc)
            await conn.send(control.Error(str(exc), ErrorCode.NOT_MEMBER))
            return False
        if existing is not None and existing is not conn:
            self._connections.pop(node_id, None)  # a stale connection: replaced, not a member going down
            existing.close()
        conn.node_id = node_id
        self._connections[node_id] = conn
        members = dict(self.membership.members())
        workers = dict(self.membership.workers())
        if not message.attach:
            members[node_id] = (message.data_host, message.data_port)
            workers[node_id] = message.workers
        await conn.send(control.RegisterAck(members=members, config=dataclasses.asdict(self.config),
                                            scheduler_time=self.clock(), workers=workers,
                                            running=not message.attach))
        if not message.attach and node_id in self._vacancies:  # a new process: its old place is void
            vacancy = self._vacancies.pop(node_id)
            await self._broadcast(control.Vacancy(node_id, vacancy.iteration, filled=True), skip=node_id)
        for vacancy in [v for n, v in sorted(self._vacancies.items()) if n != node_id]:
            await conn.send(vacancy)
        if message.attach:
            log.info("node %d re-attached from %s", node_id, conn.peer)
            return True
        log.info("node %d registers into the running job from %s (data address %s:%d); admitted at its trainer's "
                 "layout check", node_id, conn.peer, message.data_host, message.data_port)
        await self._broadcast(control.MemberUp(node_id, message.data_host, message.data_port,
                                               workers=message.workers), skip=node_id)
        return True

    async def _admit(self, node_id: int) -> int:
        """Admit a pending DC: plan a policy with it, bind its boundary iteration; that iteration."""
        self.membership.admit(node_id, self.clock())
        self._save_members()
        self._admitting.add(node_id)
        alive = self.membership.alive
        rates = self.collector.estimate(self.clock()) if self.config.enable_awareness \
            else self.planner.planned_rates or self.initial_rates
        try:
            await self._carry_out(lambda: [self.replanner.plan(rates, alive, force=True,
                                                               reason=f"node {node_id} joins")])
        finally:
            self._admitting.discard(node_id)
        answer = self.consistency.boundary(node_id)
        self._bound(answer, node_id)
        address, workers = self.membership.members()[node_id], self.membership.workers()[node_id]
        # before the joiner hears its boundary, so its chunks never reach a peer that does not expect them
        await self._broadcast(control.MemberUp(node_id, address[0], address[1], workers=workers,
                                               joins_at=answer.iteration), skip=node_id)
        log.info("node %d admitted: iteration %d (policy version %d) hands it the model", node_id, answer.iteration,
                 answer.version)
        return answer.iteration

    def _bound(self, answer: Answer, asked_by: int) -> None:
        if not answer.newly_bound:
            return
        if self.store is not None:
            self.store.save_binding(answer.iteration, answer.version, answer.joining)
        log.info("iteration %d bound to policy version %d (first asked by node %d)%s", answer.iteration,
                 answer.version, asked_by, f"; it admits {list(answer.joining)}" if answer.joining else "")

    async def _start_job(self) -> None:
        """Every node is here: plan the first policy, then tell everyone the membership and config."""
        nodes = self.membership.alive  # nothing else plans before the job is complete: no lock to wait for
        try:
            await self._carry_out(lambda: [self.replanner.first_plan(nodes)])
        except PlanningError as exc:
            log.error("%s", exc)
            await self._broadcast(control.Error(f"the scheduler cannot start the job: {exc}"))
            return
        shared = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in LOCAL}
        ack = control.RegisterAck(members=self.membership.members(), config=shared,
                                  scheduler_time=self.clock(), workers=self.membership.workers())
        await self._broadcast(ack)
        self._save_members()
        if self.store is not None:
            self.store.save_complete()
        self.complete.set()
        log.info("membership complete: nodes %s; policy %d is current", list(nodes),
                 self.consistency.current_version)

    async def _heartbeat(self, conn: _Connection, message: control.Heartbeat) -> bool:
        problem = self._member(conn, message.node_id, "heartbeat")
        if problem is None and self.credentials is not None and self.credentials.revoked(conn.proven):
            log.warning("%s: its member key is revoked; closing its connection", conn.name())
            await conn.send(control.Error(f"{conn.proven}'s member key is revoked", ErrorCode.AUTH))
            return False
        if self.store is not None and self.store.behind:
            self.store.catch_up()  # a full disk may take writes again
        if problem is None:
            try:
                self.membership.heartbeat(message.node_id, self.clock())
                if message.done or message.model_bytes:
                    self.iterations.record(message.done, message.model_bytes, self.consistency.bound_version)
                return True
            except MembershipError as exc:
                problem = str(exc)
        await conn.send(control.Error(problem, ErrorCode.NOT_MEMBER))
        return False

    async def _peer_unreachable(self, conn: _Connection, message: control.PeerUnreachable) -> None:
        """A member lost its data connection to another. Evidence, not a verdict: the peer is declared
        dead only by this scheduler's own evidence (its heartbeats, its control connection), checked now."""
        problem = self._member(conn, message.node_id, f"report on node {message.peer}")
        if problem is not None:
            log.warning("%s: ignored", problem)
            return
        alive = message.peer in self.membership.alive and message.peer in self._connections
        log.warning("node %d cannot reach node %d (%s); %s", message.node_id, message.peer, message.reason,
                    "the scheduler still hears from it" if alive else "the scheduler does not hear from it either")
        for down in self.membership.check(self.clock()):
            await self._member_down(down)

    async def _policy_request(self, conn: _Connection, message: control.PolicyRequest) -> None:
        problem = self._member(conn, message.node_id, f"policy request for iteration {message.iteration}")
        if problem is None and not self.complete.is_set():
            problem = f"policy request for iteration {message.iteration} before the membership is complete"
        if problem is not None:
            await conn.send(control.Error(problem, ErrorCode.NOT_MEMBER))
            return
        try:
            answer = self.consistency.request(message.iteration, message.known_version)
        except ConsistencyError as exc:
            await conn.send(control.Error(f"node {message.node_id}: {exc}"))
            return
        self._bound(answer, message.node_id)
        await conn.send(control.PolicyReply(answer.iteration, answer.version, answer.policy,
                                            joining=answer.joining))

    async def _layout_check(self, conn: _Connection, message: control.LayoutCheck) -> None:
        problem = self._member(conn, message.node_id, "layout check")
        code = ErrorCode.NOT_MEMBER
        first = 0
        if problem is None:
            if self._votes is None or (self._layout is not None and self._votes.adopted != self._layout):
                self._votes = LayoutVote(self.membership.expected, self._layout, configured=self.config.layout_hash)
            verdict = self._votes.check(message.node_id, message.layout_hash)
            if self._layout is None and self._votes.adopted is not None:
                self._layout = self._votes.adopted
                if self.store is not None:
                    self.store.save_layout(*self._layout)
                if self._votes.configured:
                    log.info("tensor layout %s: the configured layout_hash", self._layout[0])
                else:
                    log.info("tensor layout %s agreed by %d of %d DCs (first node %d)", self._layout[0],
                             self._votes.needed, len(self._votes.expected), self._layout[1])
            if verdict.mismatch:
                problem, code = verdict.mismatch, ErrorCode.LAYOUT_MISMATCH
            elif not verdict.agreed:
                log.info("layout check of node %d: layout %s has %d of the %d votes it needs", message.node_id,
                         message.layout_hash, verdict.votes, verdict.needed)
                await conn.send(control.LayoutAck(pending=True))
                return
        if problem is None and message.node_id in self.membership.pending:
            try:
                first = await self._admit(message.node_id)
            except (PlanningError, MembershipError, ConsistencyError) as exc:
                problem, code = f"node {message.node_id} cannot be admitted: {exc}", ErrorCode.PROTOCOL
        await conn.send(control.Error(problem, code) if problem else control.LayoutAck(first_iteration=first))

    def _link_report(self, conn: _Connection, message: control.LinkReport) -> None:
        if conn.node_id is None or (message.dst != conn.node_id and message.src != conn.node_id):
            log.warning("link report %d->%d from %s ignored: not an endpoint", message.src, message.dst,
                        conn.name())
            return
        report = message
        due = self.replanner.next_deadline()
        for action in self.replanner.link_report(report, self.clock()):
            assert isinstance(action, Log), action
            log.log(action.level, action.message, *action.args)
        if self.replanner.next_deadline() < due:
            self._replan_wake.set()

    def _edge_report(self, conn: _Connection, message: control.EdgeReport) -> None:
        problem = self._member(conn, message.node_id, "edge report")
        if problem is not None:
            log.warning("%s: ignored", problem)
            return
        self._edge[message.node_id] = (message.mode, message.fallback)
        log.info("node %d aggregates its LAN in %s%s", message.node_id, message.mode,
                 f" (XDP unavailable: {message.fallback})" if message.fallback else "")

    def _lan_report(self, conn: _Connection, message: control.LanReport) -> None:
        problem = self._member(conn, message.node_id, "LAN report")
        if problem is not None:
            log.warning("%s: ignored", problem)
            return
        if self.lan.report(message, self.clock()) or self.lan.next_deadline() is not None:
            self._lan_wake.set()   # planned now, or the loop's timer learns when the DC's hold ends

    async def _lan_loop(self) -> None:
        """Plan every DC whose LAN is due (in a worker thread) and push the plan to its gateway."""
        while True:
            deadline = self.lan.next_deadline()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if deadline is None else max(0.0, deadline - self.clock())):
                    await self._lan_wake.wait()
            self._lan_wake.clear()
            for node_id in self.lan.pending(self.clock()):
                job = self.lan.begin(node_id, self.clock())
                try:
                    plan = await asyncio.to_thread(self.lan.compute, job)
                    message = self.lan.finish(job, plan)
                except Exception as exc:  # a planner's failure must not end the scheduler
                    self.errors["lan_planning"] += 1
                    message = self.lan.finish(job, None, str(exc))
                if message is None:
                    continue
                log.info("DC %d LAN plan %d (%s): clusters %s, to the gateway %s, predicted %.3f Gbit/s",
                         node_id, message.version, message.planner, dict(message.clusters), list(message.direct),
                         message.predicted_gbit)
                conn = self._connections.get(node_id)
                if conn is not None:
                    try:
                        await conn.send(message)
                    except ConnectionError as exc:
                        log.info("could not send %s to %s: %s", message.TYPE, conn.name(), exc)
                if self.lan.due(node_id, self.clock()):  # reported again while it was planned
                    self._lan_wake.set()

    async def _override(self, conn: _Connection, message: control.PolicyOverride) -> None:
        if not self.complete.is_set():
            await conn.send(control.Error("policy override before the first policy exists"))
            return
        try:
            version = await self.replan(dict(message.rates), force=True, reason=f"override from {conn.name()}")
        except PlanningError as exc:
            await conn.send(control.Error(str(exc)))
            return
        await conn.send(control.PolicyOverrideAck(version))

    def status(self) -> control.Status:
        current = self.consistency.current_version
        bindings = sorted(self.consistency.bindings.items())[-STATUS_BINDINGS:]
        return control.Status(expected=self.membership.expected, registered=self.membership.registered,
                              alive=self.membership.alive, complete=self.complete.is_set(),
                              version=-1 if current is None else current, bindings=tuple(bindings),
                              edge=dict(self._edge), addresses=self.membership.members(), states=self._states(),
                              links=self.link_rows(), iterations=tuple(self.iterations.rows()), lan=self.lan_rows(),
                              probed=self.probing.record() if self.probing is not None else (),
                              probe_s=self.probing.seconds if self.probing is not None else -1.0)

    def link_rows(self) -> tuple[tuple[int, int, float, float, float], ...]:
        """(src, dst, believed Mbit/s, newest report or -1, its age in seconds or -1) of every link planned with."""
        now = self.clock()
        rows = []
        for (src, dst), believed in sorted(self.collector.estimate(now).items()):
            state = self.collector.state(src, dst)
            measured = state.measured and bool(state.recent_at)
            rows.append((src, dst, float(believed), float(state.latest) if measured else -1.0,
                         now - state.recent_at[-1] if measured else -1.0))
        return tuple(rows)

    def lan_rows(self) -> tuple[tuple[int, str, int, str, float], ...]:
        """(DC, aggregation mode, LAN plan version, planner, predicted Gbit/s) of every DC with a LAN tier."""
        rows = []
        for node_id in sorted(set(self._edge) | set(self.lan.plans)):
            plan = self.lan.plans.get(node_id)
            rows.append((node_id, self._edge.get(node_id, ("", ""))[0], plan.version if plan else -1,
                         plan.planner if plan else "", float(plan.predicted_gbit) if plan else 0.0))
        return tuple(rows)

    def _states(self) -> tuple[tuple[int, str, str], ...]:
        """(node, state, why) of every expected node, for operators (``netstorm status``)."""
        registered, alive, dead = set(self.membership.registered), set(self.membership.alive), self.membership.dead
        out = []
        for node_id in self.membership.expected:
            if node_id in dead:
                out.append((node_id, "down", dead[node_id]))
            elif node_id in alive and self.complete.is_set():
                out.append((node_id, "alive", ""))
            elif node_id in registered:
                out.append((node_id, "registered", "probing the links with no rate" if self.membership.complete
                            else "waiting for the other nodes"))
            else:
                out.append((node_id, "expected", "not registered yet"))
        return tuple(out)

    def history(self, since_iteration: int, since_version: int) -> control.History:
        """A page of the bindings from ``since_iteration`` on and of the published versions from
        ``since_version`` on (what a tool following the run has not seen yet)."""
        bindings = sorted((k, v) for k, v in self.consistency.bindings.items() if k >= since_iteration)
        policies = [record for record in self._published if record.version >= since_version]
        return control.History(tuple(bindings[:HISTORY_BINDINGS]), tuple(policies[:HISTORY_POLICIES]))

    def _policy_fetch(self, version: int) -> control.Message:
        current = self.consistency.current_version
        wanted = current if version == -1 else version
        if wanted is None:
            return control.Error("no policy has been planned yet", ErrorCode.NO_POLICY)
        try:
            policy = self.consistency.policy(wanted)
        except KeyError:
            return control.Error(f"policy version {version} is not held (current {current}; older versions are "
                                 "kept only while a remembered iteration uses them)", ErrorCode.NO_POLICY)
        return control.PolicyReply(-1, wanted, policy.to_wire())

    # --- membership changes and planning ---------------------------------------------------------

    async def _broadcast(self, message: control.Message, *, skip: int | None = None) -> None:
        async def one(conn: _Connection) -> None:
            try:
                await conn.send(message)
            except ConnectionError as exc:  # it is going away; its own handler reports that
                log.info("could not send %s to %s: %s", message.TYPE, conn.name(), exc)
                conn.close()

        async with asyncio.TaskGroup() as tasks:
            for node_id, conn in list(self._connections.items()):
                if node_id != skip and conn.leaving is None and not conn.writer.is_closing():  # else it is gone
                    tasks.create_task(one(conn))

    async def _member_down(self, down: Down) -> None:
        self._save_members()
        self._vacancies.pop(down.node_id, None)
        if self.probing is not None and not self._probed.is_set():
            self.probing.gone(down.node_id)
            if self.probing.done:
                self._probed.set()
        if down.pending:  # no policy names it: its peers only drop its link
            log.warning("node %d, waiting for admission, is gone: %s", down.node_id, down.reason)
            await self._broadcast(control.MemberDown(down.node_id, down.reason))
            conn = self._connections.pop(down.node_id, None)
            if conn is not None:
                conn.close()
            return
        log.log(logging.INFO if down.left else logging.WARNING, "node %d is down: %s; re-planning without it",
                down.node_id, down.reason)
        await self._broadcast(control.MemberDown(down.node_id, down.reason))
        conn = self._connections.pop(down.node_id, None)
        if conn is not None:
            conn.close()
        self.replanner.member_down()
        self._replan_wake.set()

    async def _liveness_loop(self) -> None:
        while True:
            deadline = self.membership.next_deadline()
            wait = self.config.heartbeat_interval if deadline is None else deadline - self.clock() + 0.01
            await asyncio.sleep(min(max(wait, 0.01), self.config.heartbeat_interval))
            for down in self.membership.check(self.clock()):
                await self._member_down(down)

    async def _replan_loop(self) -> None:
        self.replanner.start_timer(self.clock())
        while True:
            self._replan_wake.clear()
            wait = self.replanner.next_deadline() - self.clock()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._replan_wake.wait()
                continue  # woken or due: look again at what is due now
            try:
                await self._carry_out(lambda: self.replanner.timer(self.clock(), alive=self.membership.alive,
                                                                   complete=self.complete.is_set()))
            except PlanningError as exc:
                self.errors["planning"] += 1
                log.error("re-plan failed, keeping policy %s: %s", self.consistency.current_version, exc)

    async def replan(self, rates: Rates, *, force: bool, reason: str) -> int:
        """Plan from ``rates`` over the live nodes and publish it if it is new; the current version after."""
        return await self._carry_out(lambda: [self.replanner.plan(rates, self.membership.alive, force=force,
                                                                  reason=reason)])

    async def _carry_out(self, decide: Callable[[], list[Action]]) -> int:
        """Carry out the re-plan core's actions, from ``decide`` and from the results it is fed, in order;
        plans and moves run in a worker thread. ``LinkBeliefs`` go out once the plan lock is released.
        Returns the version current when the actions were done."""
        beliefs: list[control.LinkBeliefs] = []
        async with self._plan_lock:
            actions = collections.deque(decide())
            while actions:
                action = actions.popleft()
                match action:
                    case Plan():
                        policy = await asyncio.to_thread(self._run_plan, action)
                        actions.extend(self.replanner.planned(action, policy, alive=self.membership.alive))
                    case Publish():
                        self._publish(action.policy, action.reason)
                    case PlanMoves():
                        old = action.old
                        _, moves = await asyncio.to_thread(plan_offload, action.beliefs.rates, old.trees,
                                                           old.chunk_share, old.aux_paths, fixed_shares=True)
                        actions.extend(self.replanner.moves_planned(action, moves))
                    case PushBeliefs():
                        beliefs.append(action.beliefs)
                    case Log():
                        log.log(action.level, action.message, *action.args)
            version = self.consistency.current_version or 0
        for message in beliefs:
            await self._broadcast(message)
        return version

    def _run_plan(self, plan: Plan) -> Policy | None:
        """A ``Plan`` action's work (in a worker thread)."""
        if plan.current is None:
            return self.planner.first(plan.rates, plan.nodes)
        return self.planner.replan(plan.rates, plan.nodes, plan.current, force=plan.force)

    def _publish(self, policy: Policy, reason: str) -> None:
        joining = tuple(sorted(n for n in self._admitting if n in policy.nodes))
        self.consistency.publish(policy, joining=joining)
        self._admitting.difference_update(joining)
        if self.store is not None:
            self.store.save_policy(policy.version, policy.to_wire(), reason)
        self.publications += 1
        self._record(policy, reason)

    def _record(self, policy: Policy, reason: str) -> None:
        self._planned_rates[policy.version] = dict(policy.rates)
        while len(self._planned_rates) > POLICY_RECORDS:
            self._planned_rates.popitem(last=False)
        self._published.append(control.PolicyRecord(
            policy.version, reason, tuple(policy.roots),
            tuple((root, child, parent) for root in policy.roots for child, parent in policy.trees[root].edges())))
        shares = ", ".join(f"{root}:{share:.2f}" for root, share in sorted(policy.chunk_share.items()))
        rates = " ".join(f"{src}>{dst}:{mbit:.1f}" for (src, dst), mbit in sorted(policy.rates.items()))
        log.info("policy version %d (%s): roots %s, chunk shares %s; binds to the next iteration asked for; "
                 "planned from Mbit/s %s", policy.version, reason, list(policy.roots), shares, rates)
