"""The LAN worker's protocol without I/O: a push (or a wait for the first result), the datagrams a receive
batch holds and the shell's clock in; DATA rows and control datagrams to send, one wake-up time and the
iteration's outcome out.

``SenderCore`` holds every rule of the worker's side: the pool's send window (netstorm/lan/sendwindow.py),
the gap, stall and tail-probe timeouts (netstorm/lan/rto.py), QUERYs, the answers to the gateway's NACKs,
RESULTs gathered and PULLed (netstorm/lan/resultgather.py), the token checks, MOVED and FAILED. The asyncio
shell (netstorm/lan/sender.py) moves the bytes and runs one timer; tests drive the core with plain calls
and a fake clock."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from netstorm.lan.batch import DatagramBatch, distinct, valid_headers
from netstorm.lan.downlink import ResultTimer, report_packet
from netstorm.lan.errors import EdgeTimeout, IterationAborted, WireError
from netstorm.lan.header import Flag, Header, Kind, Precision
from netstorm.lan.kinds import GATEWAY_TOKENED
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet, data_packets, header_rows, set_epoch
from netstorm.lan.precision import integer_precision
from netstorm.lan.resultgather import ResultGather
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.rto import RetransmitTimers
from netstorm.lan.senderactions import Action, Done, Failed, Moved, Outcome, SendControl, SendData
from netstorm.lan.sendernacks import NackAnswers
from netstorm.lan.sendwindow import QUERY_CHUNKS, SendWindow
from netstorm.lan.tokens import LanTokens, Sender

PULL_CHUNKS = 1024
"""Missing result chunks PULLed per probe once results flow: a burst that overflowed the group socket can
leave most of a large model's results missing, and each probe waits a few retransmission timeouts."""
_GATEWAY_TOKENED = np.array([k in GATEWAY_TOKENED for k in range(256)])
"""Kinds (indexed by code) a worker takes only with the gateway's token (netstorm/lan/kinds.py)."""




class SenderCore:
    """The rules of one LAN worker (see the module's docstring). ``gateway`` only names the peer in errors."""

    def __init__(self, *, worker: int, job: int, tokens: LanTokens, gateway: object = None,
                 retransmit: float = 0.005, query_nacks: bool = False, pull_interval: float = 0.5) -> None:
        self.worker = worker
        self.job = job
        self.tokens = tokens
        self.gateway = gateway
        self.timers = RetransmitTimers(retransmit)
        self.query_nacks = query_nacks
        """Ask about a suspected chunk (and resend on the gateway's NACK) before resending it (deployment)."""
        self.pull_interval = pull_interval
        """Silence before the first result is PULLed (the WAN step may still run)."""
        self.epoch = 0
        """The deployment epoch this worker's DATA carries."""
        self.announced: int | None = None
        """The deployment epoch the latest accepted RESULT announced for the next iteration (None: none yet)."""
        self.downlink = ResultTimer()
        """This iteration's result burst as it arrives (netstorm/lan/downlink.py), reported to the gateway."""
        self.nacks = NackAnswers(self)
        self.retransmitted = 0
        self.stall_resends = 0
        """Chunks taken as lost because no ACK at all came for a while (the oldest unacknowledged)."""
        self.tail_probes = 0
        self.hello_again: bytes | None = None
        """Our HELLO while DATA goes to a cluster's aggregator (the shell sets it; None: to the gateway). Its
        one copy before the first DATA is all the aggregator learns our address from, and a gap is only asked
        about, so were it lost the aggregator could never NACK us: each QUERY says it again."""
        """The iteration's last outstanding chunk asked about (or resent) when its ACK did not come in time."""
        self.queries = 0
        self.pulls = 0
        """PULL datagrams sent for result chunks that did not arrive."""
        self.forged = 0
        """Datagrams dropped for not carrying the gateway's token for this worker."""
        self.widened = 0
        """Pushes of integers sent on wider lanes than asked: the narrow lane would have overflowed."""
        self.reports = 0
        self.moved = 0
        """MOVED notices taken: DATA of an iteration refused for an old deployment epoch."""
        self.outcome: Outcome | None = None
        self.iteration: int | None = None
        self.layout: EdgeLayout | None = None
        self.rows = np.zeros((0, 0), np.uint8)
        """This iteration's DATA datagrams, one row per chunk (empty while only results are awaited)."""
        self.values: list[np.ndarray] = []
        self.window: SendWindow | None = None
        """The send window while chunks are unacknowledged (None once all are, or with nothing to send)."""
        self.gather = ResultGather(ResultWire.float32(EdgeLayout.uniform([1], 0)))
        self.precision = Precision.FIXED32
        self._actions: list[Action] = []
        self._handed: tuple[int, int] | None = None
        """The chunks of the latest first sends, until the shell says they left (``sent``)."""
        self._deadline = self._timeout = self._progress = self._wake = 0.0
        self._rules: tuple[float, float | None, tuple[float, float]] = (0.0, None, (0.0, 0.0))
        """The gap's grace, its reorder allowance and the tail's (PTO, reorder), as fixed at the last wait."""

    # ------------------------------------------------------------------ events
    def push(self, iteration: int, tensors: Sequence[np.ndarray], *, layout: EdgeLayout, now: float,
             timeout: float, back: ResultWire | None = None, precision: Precision = Precision.FIXED32,
             integers: bool = False) -> None:
        """Start contributing ``tensors`` to ``iteration``; the result travels as ``back`` (None: float32 lanes
        on ``layout``). ``integers``: exact integers, sent on the narrowest lanes that hold them."""
        self._begin(iteration, layout, back, now, timeout)
        self.downlink.start(iteration)
        self.precision = precision
        self.values = [np.asarray(t, np.float32).reshape(-1) for t in tensors]
        token = self.tokens.worker(self.worker, iteration)
        wire = precision
        if integers and precision != Precision.FIXED32:
            wire = integer_precision(self.values, precision)
            self.widened += wire != precision
        parts = [data_packets(layout, job=self.job, worker=self.worker, iteration=iteration, tensor=t, values=v,
                              token=token, precision=wire) for t, v in enumerate(self.values)]
        self.rows = set_epoch(parts[0] if len(parts) == 1 else np.concatenate(parts), self.epoch)
        self.window = SendWindow(len(self.rows), layout.window)
        self._poll(now, after_receive=False)

    def first(self, *, layout: EdgeLayout, now: float, timeout: float) -> None:
        """Wait for the next result the gateway sends, whatever its iteration (how a joining worker starts)."""
        self._begin(None, layout, None, now, timeout)
        self._poll(now, after_receive=False)

    def datagrams_received(self, batch: DatagramBatch, now: float) -> None:
        """Handle a receive batch at once, then whatever its ACKs and the clock make due."""
        if self.outcome is not None or self.layout is None:
            return
        before = int(self.gather.missing.sum())
        if self.iteration is None:
            self.iteration = self._first_iteration(batch)
        if self.iteration is not None:
            try:
                self._take(batch, self.iteration, now)
            except (IterationAborted, WireError) as exc:
                self.outcome = Failed(exc)
                return
            if self.outcome is not None:
                return
        if int(self.gather.missing.sum()) < before:
            self._progress = now
        self.nacks.flush()
        self._poll(now)

    def handle_timer(self, now: float) -> None:
        """The wake-up time came (or any time after it): take what is late, PULL, or give up."""
        if self.outcome is None and self.layout is not None:
            self._poll(now)

    def get_timer(self) -> float | None:
        """When the shell must call ``handle_timer`` at the latest (None: the iteration is over)."""
        return None if self.outcome is not None or self.layout is None else self._wake

    def sent(self, now: float) -> None:
        """The shell's send of the first transmissions last asked for returned at ``now``: a window's send
        can take a while, and its chunks' timeouts start once they have left."""
        if self._handed is not None and self.window is not None and self.outcome is None:
            self.window.left(*self._handed, now)
            self._arm(self.window, now)
        self._handed = None

    def actions(self) -> list[Action]:
        """What to send, in order, since the last call."""
        out, self._actions = self._actions, []
        return out

    def send(self, action: Action) -> None:
        self._actions.append(action)

    # ------------------------------------------------------------------ HELLO
    def hello_packet(self, nonce: int, *, aggregator: bool = False) -> bytes:
        """The HELLO announcing this worker; its ``iteration`` is a fresh nonce the gateway's answer echoes."""
        return control_packet(Kind.HELLO, job=self.job, worker=self.worker, iteration=nonce,
                              flags=Flag.AGGREGATOR if aggregator else Flag.NONE,
                              token=self.tokens.of(Sender.WORKER, self.worker, nonce, keep=False))

    def hello_answer(self, reply: Header, nonce: int) -> bool:
        """Whether ``reply`` answers our HELLO under the gateway's token (a forged one is counted)."""
        if not self.tokens.enabled or (reply.iteration == nonce and reply.worker == self.worker and
                                       self.tokens.valid(Sender.GATEWAY, self.worker, nonce, reply.token, keep=False)):
            return True
        self.forged += 1
        return False

    # ------------------------------------------------------------------ rules
    def _begin(self, iteration: int | None, layout: EdgeLayout, back: ResultWire | None, now: float,
               timeout: float) -> None:
        self.outcome = None
        self.iteration = iteration
        self.layout = layout
        self.gather = ResultGather(ResultWire.float32(layout) if back is None else back)
        self.rows = np.zeros((0, 0), np.uint8)
        self.values = []
        self.window = None
        self._actions = []
        self._handed = None
        self.nacks.queued = []
        self._deadline, self._timeout = now + timeout, timeout
        self._progress = self._wake = now

    def _poll(self, now: float, *, after_receive: bool = True) -> None:
        window = self.window
        if window is not None:
            if after_receive:
                self._late(window, now)
            if not window.acked.all():
                if now >= self._deadline:
                    open_ = np.flatnonzero(~window.acked)[:8].tolist()
                    self.outcome = Failed(EdgeTimeout(
                        f"edge worker {self.worker}: iteration {self.iteration}: {window.unacked()} chunks never "
                        f"acknowledged by gateway {self.gateway} within {self._timeout} s (first: {open_})"))
                    return
                self._send_window(window, now)
                return
            self.timers.finished(window)
            self.window = None
            self._progress = now
            self._timeout = self._deadline - now
        self._gathering(now)

    def _send_window(self, window: SendWindow, now: float) -> None:
        """First sends the window allows, then the wake-up."""
        start, stop = window.sendable()
        if stop > start:
            self.send(SendData(self.rows, np.arange(start, stop), first=True))
            window.sent(start, stop, now)
            self._handed = (start, stop)
        self._arm(window, now)

    def _arm(self, window: SendWindow, now: float) -> None:
        """The wake-up: the stall's RTO, the oldest gap's time or the tail's, whichever is first."""
        # a resent chunk's ACK needs a round trip through the queue too: wait that long before again. The
        # gateway NACKs a gap itself once a later chunk completes, so a worker asks only when that is late too
        grace = self.timers.grace()
        reorder = grace if self.query_nacks else None
        probing = (self.timers.pto(), self.timers.reorder(window))
        self._rules = (grace, reorder, probing)
        wait = min(self.timers.rto(), window.gap_due(now, grace, reorder), window.probe_due(now, *probing))
        self._wake = min(self._deadline, now + wait)

    def _late(self, window: SendWindow, now: float) -> None:
        """Ask about (or resend) what the gap, stall and tail rules take as lost by ``now``."""
        grace, reorder, probing = self._rules
        gap, stalled = window.late(now, grace, self.timers.rto(), reorder)
        self.stall_resends += int(stalled.size)
        probe = window.probe(now, *probing) if not stalled.size else None
        if probe is not None:
            # nothing later can reveal the tail's loss: ask about its newest chunk (the gateway NACKs whoever
            # is missing from it), or resend it without NACKs; its ACK then reveals the rest
            self.tail_probes += 1
            gap = distinct(np.append(gap, probe)) if self.query_nacks else gap
            stalled = stalled if self.query_nacks else distinct(np.append(stalled, probe))
        if self.query_nacks:
            # a gap is only asked about (again each timeout): the gateway NACKs whoever is missing
            ask = distinct(gap)
            ask = ask[~np.isin(ask, stalled)]
            if ask.size:
                self._query(ask)
                window.resent(ask, now, asked_only=True)
                window.asked[ask] = True
            late = stalled
        else:
            late = distinct(np.concatenate([gap, stalled]))[:QUERY_CHUNKS]
        if late.size:
            # resent, and asked which of them completed (their ACKs may be what was lost)
            self.retransmitted += int(late.size)
            self.send(SendData(self.rows, late, first=False))
            window.resent(late, now)
            self._query(late)

    def _gathering(self, now: float) -> None:
        """Every result chunk in: done; else PULL what a silence says was lost, or give up at the deadline."""
        gather = self.gather
        if gather.complete():
            assert self.iteration is not None
            if self.rows.size:
                self._report(self.iteration)
            self.outcome = Done(self.iteration, gather.result(), gather.total)
            return
        if now >= self._deadline:
            what = "the first result" if self.iteration is None else f"iteration {self.iteration}"
            self.outcome = Failed(EdgeTimeout(
                f"edge worker {self.worker}: {what}: {int(gather.missing.sum())} result chunks from gateway "
                f"{self.gateway} missing after {self._timeout} s"))
            return
        # silence is measured on progress: other datagrams (ACKs of workers already in the next iteration) keep
        # coming while ours are lost. Once results flow, a gap of a few retransmission timeouts means a loss
        quiet = self.pull_interval if gather.missing.all() else max(4 * self.timers.rto(), 0.02)
        if now - self._progress >= quiet:
            if self.iteration is not None:
                self._pull(self.iteration)
            self._progress = now
        self._wake = min(self._deadline, self._progress + quiet)

    def _pull(self, iteration: int) -> None:
        """Resend queued answers, then ask for up to PULL_CHUNKS result chunks that never arrived (one while
        none has: the WAN step may still run, or every copy was lost; the gateway answers once it has it)."""
        self.nacks.flush()
        missing = self.gather.missing
        limit = 1 if missing.all() else PULL_CHUNKS
        self.downlink.on_pull()
        token = self.tokens.worker(self.worker, iteration)
        for index in np.flatnonzero(missing)[:limit]:
            tensor, chunk = self.gather.back.layout.locate(int(index))
            self.pulls += 1
            self.send(SendControl(control_packet(Kind.PULL, job=self.job, worker=self.worker, iteration=iteration,
                                                 tensor=tensor, chunk=chunk, token=token)))

    def _query(self, chunks: np.ndarray) -> None:
        """Ask the gateway about ``chunks`` (sequence numbers), QUERY_CHUNKS per datagram."""
        assert self.iteration is not None
        token = self.tokens.worker(self.worker, self.iteration)
        if self.hello_again is not None:
            self.send(SendControl(self.hello_again, aggregator=True))
        for start in range(0, chunks.size, QUERY_CHUNKS):
            part = chunks[start: start + QUERY_CHUNKS].astype("<u4")
            head = header_rows(1, kind=Kind.QUERY, job=self.job, worker=self.worker, iteration=self.iteration,
                               token=token)
            head["count"] = part.size
            head["need"] = 127
            self.queries += 1
            self.send(SendControl(head.tobytes() + part.tobytes()))

    def _report(self, iteration: int) -> None:
        """Tell the gateway how the result burst arrived (its measure of our downlink); a lost one costs a sample."""
        report = self.downlink.report()
        if report is not None:
            self.reports += 1
            self.send(SendControl(report_packet(report, job=self.job, worker=self.worker, iteration=iteration,
                                                token=self.tokens.worker(self.worker, iteration))))

    def _first_iteration(self, batch: DatagramBatch) -> int | None:
        """The iteration of the batch's first RESULT under the gateway's token (a joining worker takes whatever
        iteration the gateway is sending)."""
        heads = batch.headers()
        candidates = np.flatnonzero(valid_headers(heads, batch.lengths) & (heads["kind"] == Kind.RESULT) &
                                    (heads["job"] == self.job))
        for row in candidates:
            iteration, token = int(heads["iteration"][row]), int(heads["token"][row])
            if not self.tokens.enabled or self.tokens.valid(Sender.GATEWAY, self.worker, iteration, token) or \
                    self.tokens.valid(Sender.GROUP, 0, iteration, token):
                return iteration
            self.forged += 1
        return None

    def _take(self, batch: DatagramBatch, iteration: int, now: float) -> None:
        """Every datagram's header is checked as ``Header.decode`` would, those of another job or iteration or
        without the gateway's token are dropped, RESULT lanes are gathered and every ACK's chunk numbers go to
        the window in one call. Only RESCALE NACKs (rare) are handled one by one."""
        if not batch.count:
            return
        heads = batch.headers()
        kind = heads["kind"]
        ok = valid_headers(heads, batch.lengths)
        ok &= (heads["job"] == self.job) & (heads["iteration"] == iteration & 0xFFFFFFFF)
        if self.tokens.enabled:
            tokens = heads["token"]
            genuine = (tokens == np.uint64(self.tokens.gateway(self.worker, iteration))) | \
                (tokens == np.uint64(self.tokens.group(iteration)))
            forged = ok & _GATEWAY_TOKENED[kind] & ~genuine
            self.forged += int(forged.sum())
            ok &= ~forged
        if np.any(ok & (kind == Kind.FAILED)):
            raise IterationAborted(f"edge worker {self.worker}: iteration {iteration} failed (the gateway says so): "
                                   f"no result will come")
        # a MOVED, or a NACK, from an aggregator under another deployment than this worker's: it sends where an
        # old one said (or the aggregator is behind, and asks too); it asks for its part and sends anew
        moved = np.flatnonzero(ok & (heads["epoch"] != self.epoch) & (
            ((kind == Kind.MOVED) & (heads["worker"] == self.worker)) | (kind == Kind.NACK)))
        if self.rows.size and moved.size:
            self.moved += 1
            self.announced = int(heads["epoch"][moved[0]])
            self.outcome = Moved(self.announced)
            return
        results, fresh = self.gather.take(batch, np.flatnonzero(ok & (kind == Kind.RESULT)), self.worker)
        if fresh.size:
            self.downlink.on_results(int(batch.lengths[fresh].sum()), now)
            self.announced = int(heads["epoch"][fresh[0]])
        if self.window is not None:
            # a chunk's result says it completed as its ACK does (a gateway that streams results sends them
            # while this worker still sends); it names a data chunk only when it travels on the data's chunks
            same = self.gather.back.layout == self.layout
            self._take_acks(batch, np.flatnonzero(ok & (kind == Kind.ACK)), self.window,
                            also=results if same else None, now=now)
        if self.rows.size:
            nacks = ok & (kind == Kind.NACK)
            rescale = nacks & ((heads["flags"] & int(Flag.RESCALE)) != 0)
            self.nacks.listed(batch, np.flatnonzero(nacks & ~rescale), now)
            for row in np.flatnonzero(rescale):
                self.nacks.rescale(Header.decode(batch.datagram(int(row))), now)

    def _take_acks(self, batch: DatagramBatch, rows: np.ndarray, window: SendWindow, *, also: np.ndarray | None,
                   now: float) -> None:
        """Every chunk number the ACK ``rows`` list (and ``also``: chunks whose result came), to the window at
        once, with a round-trip sample."""
        if not rows.size and (also is None or not also.size):
            return
        listed = also if also is not None else np.zeros(0, np.int64)
        if rows.size:
            counts = batch.headers()["count"][rows].astype(np.int64)
            width = int(counts.max())
            acked = batch.lanes("<u4")[rows, :width][np.arange(width) < counts[:, None]].astype(np.int64)
            listed = np.concatenate([acked, listed])
        sample, tail = window.ack(listed[listed < window.acked.size], now)
        if sample is not None:
            self.timers.ack_sample(sample)
        if tail is not None:
            self.timers.tail_sample(tail)
