"""The node's side of the control plane: registration, heartbeats, per-iteration policies, link reports.

One TCP connection to the scheduler. Requests (layout check, policy request) are answered in order, so
each request owns one future in a FIFO; ``MemberDown`` and ``LinkBeliefs`` are the messages the
scheduler pushes on its own. Background work (reading, heartbeats, link reports, policy prefetches)
runs in one TaskGroup owned by a single runner task that ``close`` cancels and awaits. Every wait has
a deadline whose error names the scheduler's address and, for policies, the iteration.

The node rides out the loss of the scheduler (a restart, a broken connection): requests in flight are
asked again once it is back, a node keeps running the iterations whose policies it holds, and the
client reconnects with backoff and re-attaches (``Register(attach=True)``; the members it missed come
in the acknowledgement). Only after ``scheduler_grace`` seconds without the scheduler, or when it refuses
the re-attachment, does every waiter fail with ``SchedulerGone`` and ``on_lost`` fire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from netstorm import auth, authconn, control
from netstorm import config as config_module
from netstorm.authconn import Credentials
from netstorm.config import Config
from netstorm.control import ControlAuthError, ControlError, ControlTimeout, SchedulerGone
from netstorm.errors import AuthError, NetStormError
from netstorm.policy import Policy
from node.firstprobe import FirstProbe

log = logging.getLogger(__name__)

REPORT_QUEUE = 256
"""Link reports waiting to be sent; beyond this the oldest are dropped (newer ones supersede them)."""
KEEP_ITERATIONS = 8
"""Policy answers remembered behind the newest iteration asked for."""
EDGE_REASON = 400
"""Characters of an XDP fallback's reason an edge report carries (a loader's message can be long)."""
BACKOFF_FIRST = 0.05
"""Seconds before the first reconnection attempt; each failure doubles it, up to ``BACKOFF_MOST``."""
BACKOFF_MOST = 1.0
LAYOUT_RETRY_FIRST = 0.05
"""Seconds before a node asks again whether the job's layout is decided (doubling, up to the next)."""
LAYOUT_RETRY_MOST = 0.5


class _Lost(Exception):
    """Ends the runner's TaskGroup when the connection is gone."""


class _Disconnected(ControlError):
    """A request's connection broke before its answer: it is asked again once the scheduler is back."""


class SchedulerClient:
    def __init__(self, address: tuple[str, int], node_id: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, ack: control.RegisterAck, config: Config) -> None:
        self.address = address
        self.node_id = node_id
        self.members: Mapping[int, tuple[str, int]] = dict(ack.members)
        self.workers: Mapping[int, int] = {n: ack.workers_of(n) for n in ack.members}
        """Member -> workers whose gradients its contribution sums (its trainer and LAN workers)."""
        self.config = config
        self.scheduler_time = ack.scheduler_time
        self.running = ack.running
        """This node registered into a running job (a restarted or new DC), to be admitted at a boundary."""
        self._name = f"scheduler {control.format_address(address)}"
        self._credentials: Credentials | None = None
        """The job secret it proved at registration, proved again on every re-attach."""
        self._reader = reader
        self._writer = writer
        self._write_lock = asyncio.Lock()
        self._pending: collections.deque[asyncio.Future[control.Message]] = collections.deque()
        self._policy_answers: dict[int, asyncio.Future[Policy]] = {}
        self._by_version: dict[int, Policy] = {}
        self._reports: collections.deque[control.LinkReport] = collections.deque(maxlen=REPORT_QUEUE)
        self._reports_ready = asyncio.Event()
        self._down_callbacks: list[Callable[[int, str], None]] = []
        self._iteration_lost_callbacks: list[Callable[[int, int, str], None]] = []
        self._vacancy_callbacks: list[Callable[[int, int, str, bool], None]] = []
        self._part_wanted_callbacks: list[Callable[[int, int], None]] = []
        self._beliefs_callbacks: list[Callable[[control.LinkBeliefs], None]] = []
        self._lan_plan_callbacks: list[Callable[[control.LanPlan], None]] = []
        self.lan_plan: control.LanPlan | None = None
        """The newest plan of this DC's LAN tier the scheduler pushed (None before the first)."""
        self._lost_callbacks: list[Callable[[ControlError], None]] = []
        self._lost: ControlError | None = None
        self._up_callbacks: list[Callable[[int, tuple[str, int], int, int], None]] = []
        self._outage: float | None = None
        self._outage_reason = ""
        """When the connection to the scheduler broke (loop time), while the client reconnects."""
        self._connected = asyncio.Event()
        self._connected.set()
        self._registration: control.Register | None = None
        """What re-attaching sends (``connect`` fills it in)."""
        self.first_iteration = 0
        """The iteration this node's first contribution belongs to (the scheduler's ``LayoutAck``)."""
        self._joining: dict[int, tuple[int, ...]] = {}
        self.reconnections = 0
        """Times the client re-attached after losing the scheduler."""
        self._tasks: asyncio.TaskGroup | None = None
        self._started = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self.progress: Callable[[], tuple[tuple[tuple[int, float], ...], int]] | None = None
        """What each heartbeat carries for operators: (iterations completed since the last one with their
        times, the model's bytes); None sends neither."""
        self.dropped_reports = 0

    # --- lifecycle -------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, address: tuple[str, int], node_id: int, data_address: tuple[str, int], *,
                      timeout: float,  # noqa: ASYNC109 (the contract's per-call deadline)
                      workers: int = 1, credentials: Credentials | None = None,
                      probe_host: str | None = None) -> SchedulerClient:
        """Register node ``node_id``, whose contributions sum ``workers`` workers' gradients (1 + the LAN
        workers of its gateway); returns once every expected node has registered. With ``credentials``
        the connection first proves it is node ``node_id`` of the job (and the scheduler that it is).
        With ``probe_host``, a bulk-probe sink listens there until the acknowledgement, and the node
        measures the links the scheduler asks it to before the first policy (``node.firstprobe``)."""
        name = f"scheduler {control.format_address(address)}"
        writer: asyncio.StreamWriter | None = None
        sink = await FirstProbe.sink(probe_host) if probe_host is not None else None
        probe_port = int(sink.sockets[0].getsockname()[1]) if sink is not None else 0
        probing: FirstProbe | None = None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout) as budget:
                reader, writer = await authconn.open_stream(*address, credentials, plane=auth.Plane.CONTROL,
                                                            me=auth.node(node_id), timeout=timeout)
                writer.write(control.encode(control.Register(node_id, data_address[0], data_address[1],
                                                             workers=workers, probe_port=probe_port)))
                await writer.drain()
                probing = FirstProbe(node_id, writer)
                reply = await control.read_message(reader)
                while isinstance(reply, control.ProbeRequest | control.MemberDown):
                    if isinstance(reply, control.ProbeRequest):
                        # the scheduler holds the acknowledgement until the probes are in
                        budget.reschedule(loop.time() + timeout + probing.start(reply))
                        log.info("node %d: probing links to %s before the first policy", node_id,
                                 [dst for dst, _, _ in reply.targets])
                    else:  # a peer gone while the job starts: the acknowledgement's members leave it out
                        log.info("node %d: node %d is down before the job starts: %s", node_id, reply.node_id,
                                 reply.reason)
                    reply = await control.read_message(reader)
                await probing.stop()
        except BaseException as exc:  # the connection must not outlive a failed registration
            if probing is not None:
                await probing.stop()
            if writer is not None:
                writer.close()
            if isinstance(exc, TimeoutError) and not isinstance(exc, ControlError):
                raise ControlTimeout(f"{name}: node {node_id} not registered within {timeout} s "
                                     "(are all expected nodes started?)") from None
            if isinstance(exc, AuthError) and not isinstance(exc, ControlError):
                raise ControlAuthError(f"{name}: node {node_id}: {exc}") from None
            if isinstance(exc, OSError):
                raise ControlError(f"{name}: cannot register node {node_id}: {exc}") from None
            if isinstance(exc, ControlError):
                raise ControlError(f"{name}: registration of node {node_id}: {exc}") from None
            raise
        finally:
            if sink is not None:
                sink.close()
        if not isinstance(reply, control.RegisterAck):
            writer.close()
            if isinstance(reply, control.Error):
                raise control.refusal(reply, f"{name} refused node {node_id}: ")
            what = "closed the connection" if reply is None else f"answered {reply.TYPE}"
            raise ControlError(f"{name} {what} instead of acknowledging node {node_id}'s registration")
        try:
            config = config_module.resolve(overrides=ack_config(ack=reply))
        except NetStormError as exc:
            writer.close()
            raise ControlError(f"{name} sent an unusable config: {exc}") from None
        client = cls(address, node_id, reader, writer, reply, config)
        client._credentials = credentials
        client._registration = control.Register(node_id, data_address[0], data_address[1], workers=workers,
                                                attach=True)
        client._runner = asyncio.create_task(client._run(), name=f"scheduler-client-{node_id}")
        await client._started.wait()
        log.info("node %d registered with %s; members %s", node_id, name, sorted(client.members))
        return client

    async def leave(self, reason: str) -> None:
        """Tell the scheduler this node is stopping on purpose (best effort, within heartbeat_timeout),
        then ``close``."""
        if self._runner is not None and not self._runner.done() and not self._writer.is_closing():
            try:
                await self._send(control.Leave(self.node_id, reason))
            except (OSError, TimeoutError) as exc:
                log.info("node %d: could not tell %s it leaves: %s", self.node_id, self._name, exc)
        await self.close()

    async def close(self) -> None:
        """Stop background work and close the connection; pending requests fail."""
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None
        self._fail_all(ControlError(f"{self._name}: the client of node {self.node_id} was closed"))
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as requests:  # policy fetches and edge reports outlive a session
                self._tasks = requests
                while self._lost is None:
                    try:
                        async with asyncio.TaskGroup() as session:
                            session.create_task(self._read_loop())
                            session.create_task(self._heartbeat_loop())
                            session.create_task(self._report_loop())
                            self._started.set()
                    except* _Lost:
                        pass  # whichever task saw the loss reported it (_disconnected) before raising _Lost
                    if self._lost is None:
                        await self._reattach()
        finally:
            self._tasks = None
            self._started.set()

    async def _reattach(self) -> None:
        """Reconnect with backoff and re-attach, until ``scheduler_grace`` has passed since the outage
        began; then (or when refused) the scheduler is gone for good."""
        loop = asyncio.get_running_loop()
        assert self._outage is not None and self._registration is not None
        deadline = self._outage + self.config.scheduler_grace
        delay = BACKOFF_FIRST
        last = "no attempt yet"
        while loop.time() < deadline:
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(delay * 2, BACKOFF_MOST, self.config.heartbeat_interval)
            writer: asyncio.StreamWriter | None = None
            try:
                async with asyncio.timeout(min(self.config.connect_timeout, max(0.01, deadline - loop.time()))):
                    reader, writer = await authconn.open_stream(
                        *self.address, self._credentials, plane=auth.Plane.CONTROL, me=auth.node(self.node_id),
                        timeout=self.config.connect_timeout)
                    writer.write(control.encode(self._registration))
                    await writer.drain()
                    reply = await control.read_message(reader)
            except (OSError, TimeoutError, ControlError, AuthError) as exc:
                if writer is not None:
                    writer.close()
                last = str(exc) or type(exc).__name__
                continue
            if isinstance(reply, control.RegisterAck):
                self._attached(reader, writer, reply)
                return
            writer.close()
            why = reply.message if isinstance(reply, control.Error) else f"answered {reply!r}"
            self._connection_lost(SchedulerGone(f"{self._name} refused to take node {self.node_id} back: {why}"))
            return
        self._connection_lost(SchedulerGone(
            f"{self._outage_reason}; unreachable for {self.config.scheduler_grace:g} s since (scheduler_grace), "
            f"last attempt: {last}"))

    def _attached(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ack: control.RegisterAck) -> None:
        """Re-attached: the members that came and went meanwhile are told as if pushed."""
        self._reader, self._writer = reader, writer
        self._outage = None
        self.reconnections += 1
        members = dict(ack.members)
        for node_id in sorted(set(self.members) - set(members)):
            self._member_down(control.MemberDown(node_id, "it left the job while the scheduler was away"))
        for node_id in sorted(set(members) - set(self.members)):
            self._member_up(control.MemberUp(node_id, members[node_id][0], members[node_id][1],
                                             workers=ack.workers_of(node_id)))
        self.members = members
        self.workers = {n: ack.workers_of(n) for n in members}
        self._connected.set()
        log.info("node %d re-attached to %s", self.node_id, self._name)

    @property
    def lost(self) -> ControlError | None:
        """Why the connection to the scheduler is gone (None while it is up)."""
        return self._lost

    def on_member_down(self, callback: Callable[[int, str], None]) -> None:
        """Call ``callback(node_id, reason)`` when the scheduler declares a member dead."""
        self._down_callbacks.append(callback)

    def on_iteration_lost(self, callback: Callable[[int, int, str], None]) -> None:
        """Call ``callback(node_id, iteration, reason)`` when a member's part of an iteration will not come."""
        self._iteration_lost_callbacks.append(callback)

    def on_vacancy(self, callback: Callable[[int, int, str, bool], None]) -> None:
        """Call ``callback(node_id, iteration, reason, filled)`` when a member's trainer place empties from
        ``iteration`` on (``filled``: it is taken again)."""
        self._vacancy_callbacks.append(callback)

    def on_part_wanted(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(node_id, iteration)`` when a member has ``iteration`` under way and asks for this
        DC's part (this DC said its trainer place is empty)."""
        self._part_wanted_callbacks.append(callback)

    def report_vacancy(self, iteration: int, reason: str, filled: bool = False) -> None:
        """Tell the scheduler (and through it every member) that this DC's trainer place is empty from
        ``iteration`` on, or (``filled``) taken again (sent in the background; a failure is logged)."""
        if self._tasks is None:
            log.warning("node %d: vacancy from iteration %d not reported: the client is closed", self.node_id,
                        iteration)
            return
        message = control.Vacancy(self.node_id, iteration, reason[:EDGE_REASON], filled)
        self._tasks.create_task(self._report_edge(message))

    def ask_part(self, peer: int, iteration: int) -> None:
        """Ask member ``peer``, whose trainer place is empty, for its part of ``iteration`` (through the
        scheduler; sent in the background, a failure is logged)."""
        if self._tasks is None:
            log.warning("node %d: part of iteration %d not asked of node %d: the client is closed", self.node_id,
                        iteration, peer)
            return
        self._tasks.create_task(self._report_edge(control.PartWanted(self.node_id, peer, iteration)))

    def report_iteration_lost(self, iteration: int, reason: str) -> None:
        """Tell the scheduler (and through it every member) that this node's part of ``iteration`` will not
        come (sent in the background; a failure is logged)."""
        if self._tasks is None:
            log.warning("node %d: lost iteration %d not reported: the client is closed", self.node_id, iteration)
            return
        message = control.IterationLost(self.node_id, iteration, reason[:EDGE_REASON])
        self._tasks.create_task(self._report_edge(message))

    def on_member_up(self, callback: Callable[[int, tuple[str, int], int, int], None]) -> None:
        """Call ``callback(node_id, data_address, workers, joins_at)`` when a DC registers into the running
        job (``joins_at`` -1) and again when it is admitted (its boundary iteration)."""
        self._up_callbacks.append(callback)

    @property
    def connected(self) -> bool:
        """The scheduler is reachable now (False while the client rides out an outage)."""
        return self._connected.is_set() and self._lost is None

    def joining(self, iteration: int) -> tuple[int, ...]:
        """DCs ``iteration`` admits (it hands them the model), from its policy answer."""
        return self._joining.get(iteration, ())

    def on_beliefs(self, callback: Callable[[control.LinkBeliefs], None]) -> None:
        """Call ``callback(beliefs)`` when a new policy is published: the rates it was planned from, and
        moves re-planned for them for the iterations bound to an older one."""
        self._beliefs_callbacks.append(callback)

    def on_lan_plan(self, callback: Callable[[control.LanPlan], None]) -> None:
        """Call ``callback(plan)`` when the scheduler pushes a newer plan of this DC's LAN tier."""
        self._lan_plan_callbacks.append(callback)

    def report_lan(self, report: control.LanReport) -> None:
        """Describe this gateway's LAN to the scheduler (configured, or as measured), which plans its tier
        and answers with a ``LanPlan`` (sent in the background; a failure is logged)."""
        if self._tasks is None:
            log.warning("node %d: LAN report not sent: the client is closed", self.node_id)
            return
        self._tasks.create_task(self._report_edge(report))

    def on_lost(self, callback: Callable[[ControlError], None]) -> None:
        """Call ``callback(error)`` once if the connection to the scheduler is lost (not on ``close``)."""
        self._lost_callbacks.append(callback)

    # --- requests --------------------------------------------------------------------------------

    async def check_layout(self, layout_hash: str, *, timeout: float) -> None:  # noqa: ASYNC109 (the contract's per-call deadline)
        """Check this node's tensor layout against the job's; LayoutMismatch names both sides. While the job's
        layout is not decided (a majority of its DCs must agree on one), ask again, within ``timeout``."""
        delay = LAYOUT_RETRY_FIRST
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seconds = timeout
        while True:
            reply = await self._request(control.LayoutCheck(self.node_id, layout_hash), "layout check", seconds)
            if isinstance(reply, control.Error):
                raise control.refusal(reply, f"{self._name}: ")
            if not isinstance(reply, control.LayoutAck):
                raise ControlError(f"{self._name} answered a layout check with {reply.TYPE}")
            if not reply.pending:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ControlTimeout(f"{self._name}: the job's layout was not agreed by a majority of its DCs "
                                     f"within {timeout} s (layout check of node {self.node_id})")
            await asyncio.sleep(min(delay, remaining))  # the other DCs' trainers are still to register
            delay = min(2 * delay, LAYOUT_RETRY_MOST)
            seconds = round(max(deadline - loop.time(), 1e-3), 3)
        self.first_iteration = reply.first_iteration

    def prefetch(self, iteration: int) -> None:
        """Ask for ``iteration``'s policy in the background, so a later ``policy_for`` finds it answered.

        Whoever asks first binds the iteration to the scheduler's current version, so the node asks for
        k+1 when k completes here, not when k starts: a policy published while k runs then applies to
        k+1 rather than k+2, and the round trip still overlaps the trainer's compute.
        """
        self._policy_future(iteration)

    async def policy_for(self, iteration: int, *, timeout: float) -> Policy:  # noqa: ASYNC109 (the contract's per-call deadline)
        """The policy bound to ``iteration`` (cached, or asked for now)."""
        answer = self._policy_future(iteration)
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        policy = await asyncio.shield(answer)
                    break
                except TimeoutError:
                    if self._outage is None:
                        raise
                    # the scheduler is away: wait for it (the answer fails with SchedulerGone after the grace)
        except TimeoutError:
            raise ControlTimeout(f"{self._name}: no policy for iteration {iteration} within {timeout} s") from None
        except ControlError:
            if self._policy_answers.get(iteration) is answer and self._lost is None:
                del self._policy_answers[iteration]  # a later call asks again
            raise
        for old in [k for k in self._policy_answers if k < iteration - KEEP_ITERATIONS]:
            del self._policy_answers[old]
        return policy

    def report_link(self, report: control.LinkReport) -> None:
        """Queue a link report for the scheduler; never blocks (the oldest report is dropped when full)."""
        if len(self._reports) == self._reports.maxlen:
            if self.dropped_reports % REPORT_QUEUE == 0:  # said, but not once per report
                log.warning("node %d: %s is not taking link reports fast enough; dropped the oldest "
                            "(%d so far)", self.node_id, self._name, self.dropped_reports + 1)
            self.dropped_reports += 1
        self._reports.append(report)
        self._reports_ready.set()

    def report_unreachable(self, peer: int, reason: str) -> None:
        """Tell the scheduler this node lost its data connection to ``peer`` (sent in the background; a
        failure is logged). Only the scheduler decides whether ``peer`` is dead."""
        if self._tasks is None:
            log.warning("node %d: unreachable node %d not reported: the client is closed", self.node_id, peer)
            return
        message = control.PeerUnreachable(self.node_id, peer, reason[:EDGE_REASON])
        self._tasks.create_task(self._report_edge(message))

    def report_edge(self, mode: str, fallback: str = "") -> None:
        """Tell the scheduler how this gateway aggregates its LAN (``mode``) and why XDP fell back, if it
        did (sent in the background; a failure is logged, the connection's loss is seen elsewhere)."""
        if self._tasks is None:
            log.warning("node %d: edge mode %s not reported: the client is closed", self.node_id, mode)
            return
        self._tasks.create_task(self._report_edge(control.EdgeReport(self.node_id, mode, fallback[:EDGE_REASON])))

    async def _report_edge(self, message: control.EdgeReport | control.PeerUnreachable | control.LanReport
                           | control.IterationLost | control.Vacancy | control.PartWanted) -> None:
        try:
            await self._send(message)
        except (TimeoutError, ConnectionError, OSError) as exc:
            log.warning("node %d: %s not reported to %s: %s", self.node_id, message.TYPE, self._name, exc)

    def _policy_future(self, iteration: int) -> asyncio.Future[Policy]:
        answer = self._policy_answers.get(iteration)
        if answer is None:
            answer = asyncio.get_running_loop().create_future()
            answer.add_done_callback(_consume)
            self._policy_answers[iteration] = answer
            if self._lost is not None or self._tasks is None:
                why = str(self._lost) if self._lost else f"the client of node {self.node_id} is closed"
                answer.set_exception(ControlError(f"{self._name}: iteration {iteration}: {why}"))
            else:
                self._tasks.create_task(self._fetch_policy(iteration, answer))
        return answer

    async def _fetch_policy(self, iteration: int, answer: asyncio.Future[Policy]) -> None:
        known = max(self._by_version, default=-1)
        request = control.PolicyRequest(self.node_id, iteration, known)
        try:
            reply = await self._request(request, f"policy request for iteration {iteration}",
                                        self.config.iteration_timeout)
            answer.set_result(self._accept_policy(iteration, known, reply))
        except ControlError as exc:
            if not answer.done():
                answer.set_exception(exc)

    def _accept_policy(self, iteration: int, known: int, reply: control.Message) -> Policy:
        where = f"{self._name}: iteration {iteration}"
        if isinstance(reply, control.Error):
            raise ControlError(f"{where}: {reply.message}")
        if not isinstance(reply, control.PolicyReply) or reply.iteration != iteration:
            raise ControlError(f"{where}: unexpected answer {reply!r}")
        if reply.policy is None:
            held = self._by_version.get(reply.version)
            if held is None or reply.version != known:
                raise ControlError(f"{where}: told version {reply.version} is unchanged, but this node holds "
                                   f"{sorted(self._by_version)}")
            self._note_joining(iteration, reply)
            return held
        try:
            policy = Policy.from_wire(reply.policy)
        except NetStormError as exc:
            raise ControlError(f"{where}: malformed policy version {reply.version}: {exc}") from None
        if policy.version != reply.version:
            raise ControlError(f"{where}: reply says version {reply.version} but the policy is {policy.version}")
        self._note_joining(iteration, reply)
        self._by_version[policy.version] = policy
        for old in sorted(self._by_version)[:-4]:
            del self._by_version[old]
        log.info("node %d: iteration %d runs policy version %d", self.node_id, iteration, policy.version)
        return policy

    def _note_joining(self, iteration: int, reply: control.PolicyReply) -> None:
        if reply.joining:
            self._joining[iteration] = tuple(reply.joining)
            log.info("node %d: iteration %d admits node(s) %s", self.node_id, iteration, list(reply.joining))
        for old in [k for k in self._joining if k < iteration - KEEP_ITERATIONS]:
            del self._joining[old]

    async def _request(self, message: control.Message, what: str, seconds: float) -> control.Message:
        """One request's answer; asked again after the scheduler comes back if the connection broke."""
        while True:
            if self._lost is not None:
                raise ControlError(f"{self._lost} ({what})")
            await self._connected.wait()  # the runner sets it, or records why the scheduler is gone
            try:
                return await self._request_once(message, what, seconds)
            except _Disconnected:
                continue

    async def _request_once(self, message: control.Message, what: str, seconds: float) -> control.Message:
        if self._lost is not None:
            raise ControlError(f"{self._lost} ({what})")
        reply: asyncio.Future[control.Message] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(seconds):
                async with self._write_lock:
                    self._pending.append(reply)
                    self._writer.write(control.encode(message))
                    await self._writer.drain()
                return await reply
        except TimeoutError:
            raise ControlTimeout(f"{self._name}: no answer to the {what} of node {self.node_id} within "
                                 f"{seconds} s") from None
        except (ConnectionError, OSError) as exc:
            raise _Disconnected(f"{self._name}: {what} of node {self.node_id} failed: {exc}") from None

    async def _send(self, message: control.Message) -> None:
        """A message without a reply (heartbeat, link report)."""
        async with self._write_lock:
            self._writer.write(control.encode(message))
            async with asyncio.timeout(self.config.heartbeat_timeout):
                await self._writer.drain()

    # --- background ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await control.read_message(self._reader)
                if message is None:
                    raise ControlError(f"{self._name} closed the control connection of node {self.node_id}")
                if isinstance(message, control.MemberDown):
                    self._member_down(message)
                    continue
                if isinstance(message, control.IterationLost):
                    log.warning("node %d: node %d lost its part of iteration %d: %s", self.node_id, message.node_id,
                                message.iteration, message.reason)
                    _notify(self._iteration_lost_callbacks, "iteration-lost", message.node_id, message.iteration,
                            message.reason)
                    continue
                if isinstance(message, control.Vacancy):
                    log.info("node %d: node %d's trainer place is %s from iteration %d%s", self.node_id,
                                message.node_id, "taken again" if message.filled else "empty", message.iteration,
                                f": {message.reason}" if message.reason else "")
                    _notify(self._vacancy_callbacks, "vacancy", message.node_id, message.iteration, message.reason,
                            message.filled)
                    continue
                if isinstance(message, control.PartWanted):
                    _notify(self._part_wanted_callbacks, "part-wanted", message.node_id, message.iteration)
                    continue
                if isinstance(message, control.MemberUp):
                    self._member_up(message)
                    continue
                if isinstance(message, control.LinkBeliefs):
                    self._beliefs(message)
                    continue
                if isinstance(message, control.LanPlan):
                    self._lan_plan(message)
                    continue
                if not self._pending:
                    if isinstance(message, control.Error):  # e.g. a refused heartbeat, before it hangs up
                        raise SchedulerGone(f"{self._name} refused node {self.node_id}: {message.message}")
                    raise ControlError(f"{self._name} sent an unrequested {message.TYPE}")
                # Replies come in request order, so this one answers the oldest request written, even
                # if that request has timed out meanwhile: its late answer is dropped, never handed to
                # the next request.
                waiter = self._pending.popleft()
                if not waiter.done():
                    waiter.set_result(message)
        except (ControlError, ConnectionError, OSError) as exc:
            error = exc if isinstance(exc, ControlError) else ControlError(f"{self._name}: connection lost: {exc}")
            if isinstance(error, SchedulerGone):  # the scheduler itself refused this node: no way back
                self._connection_lost(error)
            else:
                self._disconnected(error)
            raise _Lost from None

    def _member_down(self, message: control.MemberDown) -> None:
        if message.node_id == self.node_id:
            log.error("node %d: the scheduler declared this node dead: %s", self.node_id, message.reason)
        else:
            log.warning("node %d: member %d is down: %s", self.node_id, message.node_id, message.reason)
        _notify(self._down_callbacks, "member-down", message.node_id, message.reason)

    def _member_up(self, message: control.MemberUp) -> None:
        log.info("node %d: node %d registers into the job from %s:%d", self.node_id, message.node_id,
                 message.data_host, message.data_port)
        members = dict(self.members)
        members[message.node_id] = (message.data_host, message.data_port)
        self.members = members
        workers = dict(self.workers)
        workers[message.node_id] = message.workers
        self.workers = workers
        _notify(self._up_callbacks, "member-up", message.node_id, (message.data_host, message.data_port),
                message.workers, message.joins_at)

    def _beliefs(self, message: control.LinkBeliefs) -> None:
        _notify(self._beliefs_callbacks, "link-beliefs", message)

    def _lan_plan(self, message: control.LanPlan) -> None:
        if message.node_id != self.node_id:
            log.warning("node %d: LAN plan for node %d ignored", self.node_id, message.node_id)
            return
        if self.lan_plan is not None and message.version <= self.lan_plan.version:
            return  # an older plan arriving late
        self.lan_plan = message
        _notify(self._lan_plan_callbacks, "lan-plan", message)

    def _disconnected(self, error: ControlError) -> None:
        """The connection broke: requests in flight are asked again after re-attaching; the scheduler is
        not given up on before ``scheduler_grace``."""
        if self._lost is not None:
            return
        if self._outage is None:
            self._outage = asyncio.get_running_loop().time()
            self._outage_reason = str(error)
            self._connected.clear()
            log.warning("node %d: %s; reconnecting for up to %g s (scheduler_grace)", self.node_id, error,
                        self.config.scheduler_grace)
        self._writer.close()
        pending = _Disconnected(str(error))
        while self._pending:
            waiter = self._pending.popleft()
            if not waiter.done():
                waiter.set_exception(pending)

    def _connection_lost(self, error: ControlError) -> None:
        self._connected.set()  # wake requests waiting for the scheduler: they fail with ``error``
        if self._lost is None:
            self._lost = error
            log.error("node %d: %s", self.node_id, error)
            for callback in list(self._lost_callbacks):
                try:
                    callback(error)
                except Exception:
                    log.exception("connection-lost callback failed")
        self._fail_all(error)

    def _fail_all(self, error: ControlError) -> None:
        while self._pending:
            waiter = self._pending.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        for answer in self._policy_answers.values():
            if not answer.done():
                answer.set_exception(error)

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval
        while True:
            try:
                done, model_bytes = self.progress() if self.progress is not None else ((), 0)
                await self._send(control.Heartbeat(self.node_id, time.time(), done=done, model_bytes=model_bytes))
            except (TimeoutError, ConnectionError, OSError) as exc:
                self._disconnected(ControlError(f"{self._name}: heartbeat of node {self.node_id} failed: "
                                                f"{exc or type(exc).__name__}"))
                raise _Lost from None
            await asyncio.sleep(interval)

    async def _report_loop(self) -> None:
        while True:
            await self._reports_ready.wait()
            self._reports_ready.clear()
            while self._reports:
                report = self._reports.popleft()
                try:
                    await self._send(report)
                except (TimeoutError, ConnectionError, OSError) as exc:
                    self._reports.appendleft(report)  # sent after re-attaching
                    self._disconnected(ControlError(f"{self._name}: link report of node {self.node_id} "
                                                    f"failed: {exc or type(exc).__name__}"))
                    raise _Lost from None


def ack_config(*, ack: control.RegisterAck) -> dict[str, object]:
    """The scheduler's config options, restricted to the ones this version knows (newer ones are ignored)."""
    return {k: v for k, v in ack.config.items() if k in config_module.FIELDS and k not in config_module.LOCAL}


def _notify(callbacks: list[Callable[..., None]], what: str, *args: object) -> None:
    """Call every callback of a pushed message; one that fails is logged and the others still run."""
    for callback in list(callbacks):
        try:
            callback(*args)
        except Exception:
            log.exception("%s callback failed", what)


def _consume(future: asyncio.Future[Policy]) -> None:
    """Mark a policy answer's exception as retrieved: prefetches nobody waits for must not warn."""
    if not future.cancelled():
        future.exception()
