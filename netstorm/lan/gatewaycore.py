"""The LAN gateway's protocol without I/O: datagrams, the aggregator's slot reports and the shell's clock in,
datagrams to send (the outbox) and iterations to wake out.

``GatewayCore`` holds every rule of the gateway's UDP port: the header and job checks, the workers' and the
aggregates' tokens, the receive window and its horizon (netstorm/lan/window.py), the per-iteration sums
(netstorm/lan/sums.py), the ACKs, the NACK rules (netstorm/lan/gatewaynacks.py), the answers to HELLO, PULL,
QUERY and REPORT, the results (netstorm/lan/gatewayresults.py), the node's failure of an iteration and a
change of deployment (netstorm/lan/gatewayroster.py). It drives its aggregator through map reads and writes
only (``Aggregator``): the XDP program's maps, or the userspace fallback fed DATA here (``userspace``). The
asyncio shell (bpf/agent.py) moves the bytes, runs one timer and wakes whoever waits for an iteration that
the core names in ``woken``; tests drive the core with plain calls and a fake clock.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from netstorm.lan.batch import DatagramBatch, distinct, valid_headers
from netstorm.lan.deploy import LanTopology
from netstorm.lan.downlink import DownlinkReports
from netstorm.lan.errors import IterationAborted, StaleDeployment, WireError
from netstorm.lan.gatewayacks import AckBook
from netstorm.lan.gatewaynacks import NackRules
from netstorm.lan.gatewayrequests import WorkerRequests
from netstorm.lan.gatewayresults import ResultBook
from netstorm.lan.gatewayroster import GatewayRoster
from netstorm.lan.header import HEADER_BYTES, KIND_AT, OFFSETS, Flag, Header, Kind, Precision, lanes_of
from netstorm.lan.kinds import CHECKED_KINDS
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.outbox import Outbox
from netstorm.lan.packets import control_packet
from netstorm.lan.redeploy import Switch
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.slots import GROUP_TOKENS, ITERATION_DONE, TOKEN_WINDOW, Aggregator, SlotEvent
from netstorm.lan.sums import IterationSums, SumsBook
from netstorm.lan.tokens import LanTokens
from netstorm.lan.uplinks import UplinkTracker
from netstorm.lan.window import ReceiveWindow

log = logging.getLogger(__name__)
Address = tuple[str, int]
_AGG = int(Kind.AGG)
_DATA = int(Kind.DATA)
_OVERFLOW = int(Flag.OVERFLOW)
"""Codes compared per batch, looked up once (an enum member's look-up costs more than the comparison)."""
_WORKER_AT, _ITERATION_AT, _TENSOR_AT, _CHUNK_AT = (OFFSETS[k] for k in ("worker", "iteration", "tensor", "chunk"))
KEEP_MODELS = 8
"""Models' worth of bulk (result copies, PULL answers) the outbox holds per destination."""
KEEP_FAILED = 8
"""Failed iterations remembered, so a worker's PULL or QUERY about one is answered with FAILED."""


class DataPlane(Aggregator, Protocol):
    """The userspace aggregator the core feeds DATA itself (bpf/fallback.py), and its slot timers."""

    def on_data(self, data: bytes | bytearray | memoryview, now: float) -> bytes | None: ...

    def expire(self, now: float) -> list[SlotEvent]: ...

    def next_deadline(self) -> float | None: ...


class GatewayCore:
    """The rules of one LAN gateway port (see the module's docstring)."""

    def __init__(self, layout: EdgeLayout, aggregator: Aggregator | DataPlane, *, workers: int, job: int,
                 userspace: bool, port: int, secret: bytes | None = None,
                 group: Address | None = None, topology: LanTopology | None = None, retransmit: float = 0.005,
                 query_nacks: bool = True, outbox_batch: int = 1,
                 widen: Callable[[bytes], tuple[bool, bytes]] | None = None,
                 cpu: Callable[[], float] = time.thread_time) -> None:
        """``userspace``: ``aggregator`` is fed DATA here (a ``DataPlane``); else only aggregates arrive, and
        ``widen`` runs a narrow datagram the program passed up through it (True: out came an aggregate).
        ``cpu`` is the clock of the delivery work's CPU time."""
        self.layout = layout
        self.workers = workers
        self.job = job
        self.aggregator = aggregator
        self.userspace = userspace
        self.query_nacks = query_nacks
        self.widen = widen
        self.cpu = cpu
        self.tokens = LanTokens(secret, job)
        self.outbox = Outbox(batch=outbox_batch, keep=KEEP_MODELS * max(1, layout.num_chunks))
        """Everything the gateway sends, in the order the shell's writer takes it (netstorm/lan/outbox.py)."""
        self.roster = GatewayRoster(layout, workers=workers, job=job, port=port, group=group, topology=topology,
                                    retransmit=retransmit, query_nacks=query_nacks, tokens=self.tokens,
                                    outbox=self.outbox)
        self.nacks = NackRules(self.roster, aggregator)
        self.results = ResultBook(self.roster, layout)
        self.window = ReceiveWindow(TOKEN_WINDOW)
        """The iterations the gateway receives (tokens installed for them) and the newest whose DATA is summed."""
        self._horizon: int | None = None
        self.agg_token = secrets.randbits(64) | 1 if self.tokens.enabled else 0
        """The value the aggregator writes into aggregates (0: tokens are not checked)."""
        aggregator.require_tokens(self.agg_token)
        aggregator.bound(None)
        self.uplinks = UplinkTracker(window=layout.num_slots, keep=TOKEN_WINDOW)
        """Each worker's first window of DATA per iteration (userspace mode): its achieved uplink."""
        self.downlinks = DownlinkReports(workers)
        """Each worker's result bursts as its REPORTs say: its achieved downlink."""
        self.book = SumsBook(self.window, workers=workers, job=job, planned=self.results.planned)
        """Every iteration's sums the gateway holds (netstorm/lan/sums.py)."""
        self.acks = AckBook(self.roster)
        self.woken: set[int] = set()
        """Iterations settled (summed, failed, done in the program) since the shell last looked: waiters wake."""
        self.hello_seen = False
        """A worker was answered since the shell last looked."""
        self.failed: dict[int, str] = {}
        """The newest iterations the node failed (``fail``), and why."""
        self.kernel_results = False
        """The program returns each chunk's result itself; the core handles slot reports and overflow only."""
        self.done_through: int | None = None
        """The newest iteration every chunk of which completed in the program (its ring-buffer reports)."""
        self.requests = WorkerRequests(self)
        """The answers to the workers' HELLO, PULL, QUERY and REPORT (netstorm/lan/gatewayrequests.py)."""
        self.errors = 0
        self.delivery_cpu = 0.0
        """CPU seconds spent taking completed slots into the iteration's sums."""

    # ------------------------------------------------------------------ the window
    def expect(self, iteration: int) -> None:
        """Receive ``iteration`` and the TOKEN_WINDOW - 1 after it from now on, nothing older: their tokens go
        in (with a secret), older sums nobody waits for go, and the horizon moves."""
        fresh = self.window.expect(iteration)
        if fresh is not None:
            self.book.forget_before(iteration)
            if self.tokens.enabled and fresh:
                self.aggregator.install_tokens([(w, k, self.tokens.worker(w, k)) for k in fresh
                                                for w in range(self.workers)])
                if self.kernel_results:   # the token of the results the program sends the group
                    self.aggregator.install_tokens([(GROUP_TOKENS, k, self.tokens.group(k)) for k in fresh])
        self._bound()

    def _bound(self) -> None:
        horizon = self.window.horizon
        if horizon != self._horizon:
            self._horizon = horizon
            self.aggregator.bound(horizon)

    def _complete(self, iteration: int) -> None:
        """Every chunk of ``iteration`` is summed, or it failed: its workers may send the next one."""
        if self.window.complete(iteration):
            self._bound()

    def collected(self, iteration: int, sums: IterationSums) -> None:
        """The shell stopped waiting for ``iteration`` (its sums taken, or it failed or timed out)."""
        self.results.drop_stream(iteration)
        self.book.collected(iteration, sums)

    # ------------------------------------------------------------------ results from the kernel
    def results_from_kernel(self) -> None:
        """The program sends every result itself from now on (``EdgeAgent.return_results_from_kernel``)."""
        if self.roster.addresses or self.results.wires:
            raise ValueError("results from the kernel are chosen before any worker says HELLO or a round is planned")
        self.kernel_results = self.roster.kernel_results = self.nacks.kernel_results = True
        self.book.lanes_kept = False
        if self.tokens.enabled and self.window.base is not None:
            self.aggregator.install_tokens([(GROUP_TOKENS, k, self.tokens.group(k))
                                            for k in range(self.window.base, self.window.installed + 1)])

    def done(self, iteration: int) -> bool:
        """Whether ``iteration`` completed in the program (iterations compared modulo 2**32)."""
        if self.done_through is None:
            return False
        return ((self.done_through - iteration) & 0xFFFFFFFF) < 2**31

    def on_done(self, iteration: int) -> None:
        """Every chunk of ``iteration`` completed in the program. The window then starts at it, not at the
        next: a worker that lost one of its results still resends its DATA (the program sends the result
        again), so its tokens stay installed until the next iteration completes too."""
        if self.done(iteration):
            return
        self.done_through = iteration
        self.window.complete(iteration)
        self.expect(iteration)
        self.woken.add(iteration)

    # ------------------------------------------------------------------ the node's verbs
    def plan(self, iteration: int, layout: EdgeLayout, *, integer: bool = False,
             back: ResultWire | None = None) -> None:
        """Iteration ``iteration`` travels on ``layout`` and its result goes back as ``back`` says."""
        if self.kernel_results:
            raise ValueError("a planned round's result is the agent's to send: not with results from the kernel")
        self.results.plan(iteration, layout, integer=integer, back=back)

    def redeploy(self, topology: LanTopology, iteration: int) -> Switch | None:
        """Run ``topology`` from iteration ``iteration + 1`` on (``GatewayRoster.switch``); the aggregator's
        expected contributors and epoch are rewritten in place."""
        if self.kernel_results:
            raise ValueError("a live re-deployment switches at the node's release of a result: not with results "
                             "from the kernel")
        switch = self.roster.switch(topology, iteration)
        if switch is not None:
            self.aggregator.redeploy(expected=self.roster.expected, epoch=switch.epoch)
        return switch

    def send_results(self, iteration: int, results: Sequence[np.ndarray], *, total: int, unicast: bool) -> list[int]:
        """Queue ``iteration``'s result for every worker and expect the next; the workers with no address."""
        self.expect(iteration + 1)   # the workers' next DATA
        self.results.send(iteration, results, total=total, unicast=unicast)
        return [w for w in range(self.workers) if w not in self.roster.addresses]

    def stream_results(self, iteration: int, *, total: int, unicast: bool = False) -> None:
        """The result of ``iteration`` leaves chunk by chunk as its chunks complete (``ResultBook.stream``)."""
        if not self.book.accepts(iteration):
            raise ValueError(f"iteration {iteration} is outside the window the gateway receives")
        self.results.stream(iteration, self.book.sums(iteration), total=total, unicast=unicast)

    def finish_stream(self, iteration: int) -> None:
        """Streamed ``iteration`` is complete: its last results leave, the next iteration is expected."""
        self.results.finish(iteration)
        self.expect(iteration + 1)

    def fail(self, iteration: int, reason: str = "") -> None:
        """The node failed ``iteration``: its sums, if still being collected, end with ``IterationAborted``;
        the workers are told with one FAILED datagram (to the group, or a unicast copy each) and go on with
        the next iteration. A worker that missed it learns it from the answer to its next PULL or QUERY."""
        self.failed[iteration] = reason
        for old in sorted(self.failed)[:-KEEP_FAILED]:
            del self.failed[old]
        self.window.complete(iteration)
        sums = self.book.open.get(iteration)
        if sums is not None and not sums.done and sums.failure is None:
            sums.failure = IterationAborted(f"edge gateway: iteration {iteration} failed at the node"
                                            f"{': ' + reason if reason else ''}")
            self.woken.add(iteration)
        self.expect(iteration + 1)   # the workers' next DATA
        if self.roster.group is not None:
            self.roster.control(control_packet(Kind.FAILED, job=self.job, worker=0, iteration=iteration,
                                               token=self.tokens.group(iteration)), self.roster.group)
            return
        notice = control_packet(Kind.FAILED, job=self.job, worker=0, iteration=iteration)
        for w, address in self.roster.addresses.items():
            self.roster.control(self.roster.stamp(notice, w), address)

    # ------------------------------------------------------------------ events in
    def datagrams(self, batch: DatagramBatch, now: float) -> None:
        """A received batch: every header checked at once (``valid_headers``); valid AGG datagrams are taken
        together (``_take_aggs``), anything else one by one (``datagram``), where an invalid one is rejected
        and logged without affecting the rest of the batch. Then the gap rule, and the NACKs, ACKs and
        streamed results the batch made leave."""
        if batch.count:
            heads = batch.headers()
            aggs = valid_headers(heads, batch.lengths) & (heads["kind"] == _AGG)
            if not self.userspace and aggs.any():
                self._take_aggs(batch, np.flatnonzero(aggs), now)
            else:
                aggs[:] = False
            kinds = heads["kind"]
            for row in np.flatnonzero(~aggs).tolist():
                data = batch.datagram(row)
                try:
                    if self.userspace and kinds[row] == _DATA:
                        # the userspace aggregator's DATA: no answer goes back, so no address is needed
                        self._measure(int(heads["worker"][row]), int(heads["iteration"][row]),
                                      int(heads["tensor"][row]), int(heads["chunk"][row]), len(data), now)
                        self._fed(data, now)
                    else:
                        self.datagram(data, batch.address(row), now)
                except StaleDeployment as exc:
                    self.roster.on_stale(exc, batch.address(row), now)
                except WireError as exc:
                    self.errors += 1
                    log.warning("edge gateway: rejected datagram from %s: %s", batch.address(row), exc)
        self.flush(now)

    def flush(self, now: float) -> None:
        """What a wake-up gathered leaves: the gap rule's NACKs, every NACK, the ACKs and streamed results."""
        if self.query_nacks:
            self.nacks.gaps(list(self.book.open.values()), now)
        if self.nacks.pending:
            self.nacks.flush(now)
        if self.acks.pending:
            self.acks.flush()
        if self.results.streams:
            self.results.flush()

    def _fed(self, data: bytes, now: float) -> None:
        """DATA into the userspace aggregator; an aggregate it completes is taken."""
        assert self.userspace
        agg = self.aggregator.on_data(data, now)  # type: ignore[union-attr]
        if agg is not None:
            self._on_agg(agg, now)

    def datagram(self, data: bytes, address: Address, now: float) -> None:
        """One datagram that is not an aggregate of a batch, to its kind's handler (``_RAW``, ``_REQUESTS``: from the
        registry in netstorm/lan/kinds.py); WireError (or StaleDeployment) for one refused.

        The data plane's kinds (unchecked: DATA, AGG) go to their handler as bytes, before any decoding; a
        worker's request (checked) is decoded, its job and worker id checked, and its handler checks the
        token (``WorkerRequests.admit``) once its own cheap filters pass."""
        kind = data[KIND_AT] if len(data) >= HEADER_BYTES else 0
        raw = _RAW.get(kind)
        if raw is not None:
            raw(self, data, address, now)
            return
        head = Header.decode(data)
        if head.job != self.job:
            raise WireError(f"datagram of job {head.job}, this gateway serves job {self.job}")
        handler = _REQUESTS.get(kind)
        if handler is None:
            raise WireError(f"unexpected {head.kind.name} datagram from {address}")
        if head.worker >= self.workers:
            raise WireError(f"{head.kind.name} from worker {head.worker}: this gateway serves workers "
                            f"0..{self.workers - 1}")
        handler(self.requests, head, data, address, now)

    # ------------------------------------------------------------------ the kinds' handlers (kinds.py)
    def _on_agg_datagram(self, data: bytes, address: Address, now: float) -> None:
        """An AGG from the XDP program (the userspace aggregator hands its aggregates over directly)."""
        if self.userspace:
            raise WireError(f"AGG datagram from {address}: only the XDP data plane makes them")
        self._on_agg(data, now)

    def _on_data(self, data: bytes, address: Address, now: float) -> None:
        """DATA: the userspace aggregator's own, fed to it, or one the XDP program passed up."""
        if self.userspace:
            iteration, tensor, chunk = (int.from_bytes(data[at: at + 4], "little")
                                        for at in (_ITERATION_AT, _TENSOR_AT, _CHUNK_AT))
            self._measure(data[_WORKER_AT], iteration, tensor, chunk, len(data), now)
            try:
                self._fed(data, now)
            except StaleDeployment as exc:
                self.roster.on_stale(exc, address, now)
            return
        head = Header.decode(data)
        if head.job != self.job:
            raise WireError(f"datagram of job {head.job}, this gateway serves job {self.job}")
        self._passed_data(head, data, address, now)

    def _passed_data(self, head: Header, data: bytes, address: Address, now: float) -> None:
        """DATA the XDP program passed up instead of summing it."""
        if head.epoch != self.roster.epoch:
            # the program passes up DATA of another epoch (its token checked there): told, never summed
            self.roster.on_stale(StaleDeployment("", worker=head.worker, iteration=head.iteration,
                                                 epoch=head.epoch), address, now)
        elif head.precision != Precision.FIXED32 and self.widen is not None:
            # narrow lanes the program could not widen in place: widened here, aggregated there
            aggregate, out = self.widen(data)
            if aggregate:
                self._on_agg(out, now)
            elif self.roster.group is not None and len(out) >= HEADER_BYTES and out[KIND_AT] == Kind.RESULT:
                self.roster.control(out, self.roster.group)   # the program's own result, where it would have gone
        else:
            raise WireError(f"DATA from worker {head.worker} reached the agent in xdp mode (malformed?)")

    def slot_events(self, events: list[SlotEvent], now: float) -> None:
        """The aggregator's reports: unclustered missing workers are NACKed, a missing cluster aggregator's
        service is asked to NACK its own missing members; an iteration the program completed moves the window."""
        clusters = self.roster.topology.clusters
        for event in events:
            if event.slot == ITERATION_DONE:
                if event.job == self.job and self.kernel_results:
                    self.on_done(event.iteration)
                continue
            if event.job != self.job or not self.book.accepts(event.iteration):
                continue
            sums = self.book.sums(event.iteration)
            found = sums.on_event(event)
            if found is None:
                continue
            seq, missing = found
            if clusters:
                self.nacks.clusters(sums, [(w, seq) for w in missing if w in clusters], now)
                missing = [w for w in missing if w not in clusters]
            for worker in missing:   # gathered: one NACK datagram per worker for every report of this wake-up
                self.nacks.add(event.iteration, worker, np.array([seq], np.int64))
        if self.nacks.pending:
            self.nacks.flush(now)
        if self.acks.pending:
            self.acks.flush()

    def next_timer(self) -> float | None:
        """When ``handle_timer`` is due (the userspace aggregator's next slot timer; None: none armed)."""
        return self.aggregator.next_deadline() if self.userspace else None  # type: ignore[union-attr]

    def handle_timer(self, now: float) -> None:
        """The userspace aggregator's slot timers that ran out, reported as the program's would be."""
        if self.userspace:
            self.slot_events(self.aggregator.expire(now), now)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ aggregates
    def _on_agg(self, data: bytes, now: float) -> None:
        started = self.cpu()
        try:
            self._take_agg(data, now)
        finally:
            self.delivery_cpu += self.cpu() - started

    def _take_agg(self, data: bytes, now: float) -> None:
        head = Header.decode(data)
        if self.agg_token and head.token != self.agg_token:
            self.roster.forged += 1
            return
        if head.job != self.job:
            return
        book = self.book
        if not book.accepts(head.iteration):
            if head.iteration in book.finished:   # a re-emitted aggregate: its ACK was lost, say it again
                with contextlib.suppress(WireError):
                    self.acks.add(head.iteration, [book.finished[head.iteration].layout.seq(head.tensor, head.chunk)])
            return
        sums = book.sums(head.iteration)
        self.nacks.rescale(sums.on_agg(head, lanes_of(data), now), now)
        if not sums.is_pending(head.tensor, head.chunk) and sums.failure is None:
            self.acks.add(head.iteration, [sums.layout.seq(head.tensor, head.chunk)])
        self._settled(head.iteration, sums)

    def _settled(self, iteration: int, sums: IterationSums) -> None:
        if sums.done:
            self._complete(iteration)
        if sums.done or sums.failure is not None:
            self.woken.add(iteration)

    def _take_aggs(self, batch: DatagramBatch, rows: np.ndarray, now: float) -> None:
        """The valid AGG datagrams of a batch at once: the token checked, other jobs dropped, each iteration's
        aggregates taken into its sums with one copy (``IterationSums.take``) and ACKed; an aggregate of an
        iteration already collected (re-emitted because its ACK was lost) is ACKed again. An aggregate flagged
        OVERFLOW (rare: a RESCALE round follows) goes through ``_take_agg``."""
        started = self.cpu()
        try:
            heads = batch.headers()
            if self.agg_token:
                genuine = heads["token"][rows] == np.uint64(self.agg_token)
                self.roster.forged += int((~genuine).sum())
                rows = rows[genuine]
            rows = rows[heads["job"][rows] == self.job]
            iterations = heads["iteration"][rows]
            # one iteration, nearly always: no sort to find it
            for value in (iterations[:1] if iterations.size and (iterations == iterations[0]).all()
                          else distinct(iterations)):
                iteration = int(value)
                mine = rows[iterations == value]
                if not self.book.accepts(iteration):
                    finished = self.book.finished.get(iteration)
                    if finished is not None:   # re-emitted aggregates: their ACKs were lost, say them again
                        seqs, known = finished.layout.seqs(heads["tensor"][mine], heads["chunk"][mine])
                        self.acks.add(iteration, seqs[known].tolist())
                    continue
                sums = self.book.sums(iteration)
                overflow = (heads["flags"][mine] & _OVERFLOW) != 0
                for row in mine[overflow]:
                    try:
                        self._take_agg(batch.datagram(int(row)), now)
                    except WireError as exc:
                        self.errors += 1
                        log.warning("edge gateway: rejected aggregate: %s", exc)
                plain = mine[~overflow]
                if plain.size and self.kernel_results:
                    continue    # passed up before the program returned results itself: they went to nobody
                if plain.size:
                    seqs, bad = sums.take(heads[plain], batch.lanes("<i4"), plain, now=now)
                    if bad:
                        self.errors += bad
                        log.warning("edge gateway: rejected %d aggregates of iteration %d naming no chunk of the "
                                    "layout (or with a wrong lane count)", bad, iteration)
                    self.acks.add(iteration, seqs.tolist())
                self._settled(iteration, sums)
        finally:
            self.delivery_cpu += self.cpu() - started

    def _measure(self, worker: int, iteration: int, tensor: int, chunk: int, nbytes: int, now: float) -> None:
        """Count a DATA datagram towards its worker's achieved uplink (netstorm/lan/uplinks.py)."""
        if not self.book.accepts(iteration):
            return
        layout = self.results.layout_of(iteration)
        if tensor >= len(layout.sizes) or chunk >= layout.chunks[tensor]:
            return
        self.uplinks.on_data(worker, iteration, layout.first_slot[tensor] + chunk, nbytes, now)


_RAW: dict[int, Callable[..., None]] = {int(k): getattr(GatewayCore, k.spec.gateway) for k in Kind
                                         if k.spec.gateway is not None and k not in CHECKED_KINDS}
_REQUESTS: dict[int, Callable[..., None]] = {int(k): getattr(WorkerRequests, k.spec.gateway) for k in CHECKED_KINDS
                                             if k.spec.gateway is not None}
"""Each kind's handler as the registry names it (netstorm/lan/kinds.py): a ``GatewayCore`` method taking the
bytes, or for a worker's request a ``WorkerRequests`` method taking the decoded header. A name with no method
fails here, at import; a kind without one is refused as unexpected."""
