"""The gateway's edge agent: turns completed slots into per-iteration LAN sums, NACKs missing workers,
recovers overflow by re-quantisation, and hands results back to the workers.

``IterationSums`` is the sans-I/O core (fed AGG datagrams and slot reports, returns datagrams to send);
``EdgeAgent`` is the asyncio shell around one UDP socket. In "xdp" mode the kernel aggregates and only
AGG datagrams and ring-buffer reports reach the agent; in "userspace" mode the agent feeds DATA to
``UserspaceAggregator`` itself. Both modes speak the same wire format to the same workers. Every
completed chunk is ACKed (the ACKs of one batch of datagrams in one datagram, multicast once to the
group, so the workers' pool windows move); results go to the group once; a QUERY is answered with the
ACKs a worker missed; the HELLO answer carries the worker's deployment (``netstorm/lan/deploy.py``).
Everything the agent sends leaves through one outbox and one writer task (``bpf/outbox.py``,
``bpf/writer.py``): a full send buffer is back-pressure, never a failure; in userspace mode the agent
also times each worker's first window of DATA (``bpf/uplinks.py``), its achieved uplink.

With a job secret (``secret``) every datagram is authenticated by its token (netstorm/lan/tokens.py): the
agent installs the tokens of the iterations it may receive next into the aggregator (kernel map or
fallback), checks HELLO and PULL tokens itself, accepts an AGG only with the value it gave the
aggregator, and stamps every datagram it sends a worker with that worker's gateway token. Whatever
arrives, the agent allocates per-iteration state only for iterations in the window it installed tokens
for, so forged or stray datagrams cannot grow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bpf.fallback import UserspaceAggregator
from bpf.outbox import Outbox
from bpf.uplinks import UplinkTracker
from bpf.writer import SocketWriter
from bpf.xdp import TOKEN_WINDOW, XDP_PASS, SlotEvent, XdpAggregator
from netstorm.lan import udp
from netstorm.lan.deploy import Deployment, LanTopology
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.fixedpoint import rescale_for
from netstorm.lan.header import (
    HEADER_BYTES,
    KIND_AT,
    MAX_LANES,
    OFFSETS,
    TOKEN_AT,
    Flag,
    Header,
    Kind,
    Precision,
    lanes_of,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import ack_packets, control_packet, result_packets, with_token
from netstorm.lan.tokens import LanTokens, Sender

log = logging.getLogger(__name__)
Address = tuple[str, int]
HELLO_NONCES = 16
"""HELLO nonces remembered per worker: a replayed HELLO from another address is refused."""
_ITERATION_AT = OFFSETS["iteration"]
_WORKER_AT = OFFSETS["worker"]
_TENSOR_AT = OFFSETS["tensor"]
_CHUNK_AT = OFFSETS["chunk"]
KEEP_MODELS = 8
"""Models' worth of bulk (result copies, PULL answers) the outbox holds per destination."""


@dataclass
class IterationSums:
    """One iteration's LAN sums, filled chunk by chunk from AGG datagrams.

    Each completed slot's int32 lanes and scale are stored as they come (one row copy per datagram);
    the conversion to floats runs once per tensor, vectorised, when the iteration is complete."""

    layout: EdgeLayout
    iteration: int
    workers: int
    job: int
    pending: set[tuple[int, int]] = field(init=False)
    missing: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    rescaled: int = 0

    def __post_init__(self) -> None:
        self.pending = {(t, c) for t, n in enumerate(self.layout.chunks) for c in range(n)}
        self.raw = np.zeros((self.layout.num_chunks, self.layout.lanes), np.int32)
        self.scales = np.zeros(self.layout.num_chunks, np.int64)

    @property
    def done(self) -> bool:
        return not self.pending

    def on_agg(self, head: Header, lanes: np.ndarray) -> list[tuple[int, bytes]]:
        """Take a completed slot; an overflowed one yields RESCALE NACKs to every worker instead."""
        key = (head.tensor, head.chunk)
        if key not in self.pending:
            return []
        if head.flags & Flag.OVERFLOW:
            scale = rescale_for(head.need, self.workers)
            if scale >= head.scale:
                raise WireError(f"iteration {self.iteration} tensor {head.tensor} chunk {head.chunk}: overflow at "
                                f"scale {head.scale} but the workers' values need scale {head.need}")
            self.rescaled += 1
            nack = control_packet(Kind.NACK, job=self.job, worker=0, iteration=self.iteration, tensor=head.tensor,
                                  chunk=head.chunk, slot=head.slot, scale=scale, flags=Flag.RESCALE)
            return [(w, nack) for w in range(self.workers)]
        start, stop = self.layout.bounds(head.tensor, head.chunk)
        if head.count != stop - start or lanes.size < head.count:
            raise WireError(f"AGG for tensor {head.tensor} chunk {head.chunk} has {head.count} lanes, "
                            f"expected {stop - start}")
        row = self.layout.seq(head.tensor, head.chunk)
        self.raw[row, : head.count] = lanes[: head.count]
        self.scales[row] = head.scale
        self.pending.discard(key)
        self.missing.pop(key, None)
        return []

    def on_event(self, event: SlotEvent) -> list[tuple[int, bytes]]:
        """NACK exactly the workers a slot report says are missing."""
        key = (event.tensor, event.chunk)
        if key not in self.pending:
            return []
        self.missing[key] = event.missing
        nack = control_packet(Kind.NACK, job=self.job, worker=0, iteration=self.iteration, tensor=event.tensor,
                              chunk=event.chunk, slot=event.slot, scale=event.scale)
        return [(w, nack) for w in event.missing]

    def result(self) -> list[np.ndarray]:
        """Every tensor's sum: exact int32 lanes times 2**-scale (float64, exact), rounded once to float32."""
        out = []
        for t, size in enumerate(self.layout.sizes):
            rows = slice(self.layout.first_slot[t], self.layout.first_slot[t] + self.layout.chunks[t])
            block = self.raw[rows].astype(np.float64) * np.exp2(-self.scales[rows].astype(np.float64))[:, None]
            out.append(block.reshape(-1)[:size].astype(np.float32))
        return out

    def describe_missing(self) -> str:
        shown = sorted(self.pending)[:5]
        parts = [f"tensor {t} chunk {c} missing workers {self.missing.get((t, c), 'unknown (no report yet)')}"
                 for t, c in shown]
        more = f" and {len(self.pending) - len(shown)} more" if len(self.pending) > len(shown) else ""
        return "; ".join(parts) + more


class EdgeAgent:
    """The asyncio agent on the gateway's UDP port: drives the XDP aggregator (its ring buffer) or the
    userspace one (fed DATA here), and answers the LAN workers."""

    def __init__(self, sock: socket.socket, layout: EdgeLayout, *, workers: int, job: int, mode: str,
                 xdp: XdpAggregator | None = None, slot_timeout: float = 0.2, max_nacks: int = 20,
                 secret: bytes | None = None, group: tuple[str, int] | None = None,
                 topology: LanTopology | None = None, retransmit: float = 0.005) -> None:
        """``layout`` fixes the pool (``layout.pool``) and lanes per datagram; ``group`` is the multicast
        (address, port) for ACKs and results (None: a unicast copy per worker); ``topology`` says which
        workers aggregate which (None: one level); ``retransmit`` is what workers are told to wait for
        progress before resending."""
        if mode not in ("xdp", "userspace"):
            raise ValueError(f"mode must be 'xdp' or 'userspace', got {mode!r}")
        if mode == "xdp" and xdp is None:
            raise ValueError("xdp mode needs a loaded XdpAggregator")
        self.sock = sock
        self.layout = layout
        self.workers = workers
        self.job = job
        self.mode = mode
        self.xdp = xdp
        self.slot_timeout = slot_timeout
        self.group = group
        self.topology = topology if topology is not None else LanTopology(workers)
        if self.topology.workers != workers:
            raise ValueError(f"the LAN topology has {self.topology.workers} workers, the agent {workers}")
        self.retransmit = retransmit
        self.expected = self.topology.gateway_mask()
        self._aggregators: dict[int, Address] = {}
        """Cluster aggregator services that said HELLO: where their members send DATA."""
        self._acks: dict[int, list[int]] = {}
        """iteration -> chunk sequence numbers to ACK after this batch of datagrams."""
        self.acks_sent = 0
        self.outbox = Outbox(batch=udp.GSO_SEGMENTS if hasattr(socket, "SOL_UDP") else 1,
                             keep=KEEP_MODELS * max(1, layout.num_chunks))
        """Everything the agent sends, sent by one task (bpf/outbox.py, bpf/writer.py)."""
        self.writer = SocketWriter(sock, self.outbox, who="edge gateway")
        self._wake = self.writer.wake
        self.uplinks = UplinkTracker(window=layout.num_slots, keep=TOKEN_WINDOW)
        """Each worker's first window of DATA per iteration (userspace mode): its achieved uplink."""
        if group is not None and sock.getsockname()[0] not in ("0.0.0.0", ""):
            udp.multicast_from(sock, address=sock.getsockname()[0])
        self.fallback = (UserspaceAggregator(layout, job=job, expected=self.expected, timeout=slot_timeout,
                                             max_nacks=max_nacks) if mode == "userspace" else None)
        self.tokens = LanTokens(secret, job)
        self.agg_token = secrets.randbits(64) | 1 if self.tokens.enabled else 0
        """The value the aggregator writes into aggregates (0: tokens are not checked)."""
        self.forged = 0
        """Datagrams the agent itself dropped for a wrong token (HELLO, PULL, AGG); ``bad_tokens`` adds the
        aggregator's count of DATA."""
        aggregator = self.fallback if self.fallback is not None else xdp
        assert aggregator is not None
        self._aggregator: UserspaceAggregator | XdpAggregator = aggregator
        aggregator.require_tokens(self.agg_token)
        self._base: int | None = None
        """Lowest iteration the agent may still receive; tokens are installed for TOKEN_WINDOW from here."""
        self._installed = -1
        """Highest iteration whose tokens are installed."""
        self._nonces: dict[int, deque[int]] = {}
        self.addresses: dict[int, Address] = {}
        self._hello = asyncio.Event()
        self._open: dict[int, IterationSums] = {}
        self._finished: dict[int, IterationSums] = {}
        self._waiters: dict[int, asyncio.Event] = {}
        self._results: dict[int, np.ndarray] = {}
        self.receive_cpu = 0.0
        """Thread CPU seconds spent receiving and handling datagrams (not sending: no result broadcast)."""
        self.delivery_cpu = 0.0
        """Part of receive_cpu spent taking completed slots into the iteration's sums (same in both modes)."""
        self.errors = 0
        self._tasks: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()
        self._buf = bytearray(HEADER_BYTES + 4 * MAX_LANES + 64)
        self._view = memoryview(self._buf)

    async def run(self) -> None:
        """Serve until ``close``: receiving (a reader callback), sending, slot timers (userspace) or the
        ring buffer (xdp)."""
        loop = asyncio.get_running_loop()
        if self.xdp is not None and self.mode == "xdp":
            loop.add_reader(self.xdp.events_fd, self._on_ring)
        # one persistent reader: no future or re-registration per wake-up, which would cost more than
        # handling the datagram itself
        loop.add_reader(self.sock.fileno(), self._drain)
        try:
            async with asyncio.TaskGroup() as tg:
                send = tg.create_task(self.writer.run())
                timers = tg.create_task(self._timers()) if self.fallback is not None else None
                await self._stop.wait()
                for task in (send, timers):
                    if task is not None:
                        task.cancel()
        finally:
            loop.remove_reader(self.sock.fileno())
            if self.xdp is not None and self.mode == "xdp":
                loop.remove_reader(self.xdp.events_fd)

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ public verbs
    @property
    def send_stalls(self) -> int:
        """Sends the kernel refused for a full buffer (EAGAIN, ENOBUFS) and the writer waited out."""
        return self.writer.stalls

    @property
    def send_errors(self) -> int:
        """Batches dropped for another send error (logged): the protocol's own recovery repeats them."""
        return self.writer.errors

    @property
    def bad_tokens(self) -> int:
        """Datagrams dropped for a wrong token: DATA in the aggregator (the XDP program's own counter, read
        from its map, or the fallback's) plus what the agent dropped itself."""
        stats = self.xdp.stats() if self.xdp is not None and self.mode == "xdp" else (
            self.fallback.counters if self.fallback is not None else {})
        return int(stats.get("bad_token", 0)) + self.forged

    def expect(self, iteration: int) -> None:
        """From now on receive ``iteration`` and the TOKEN_WINDOW - 1 after it, nothing older: installs their
        tokens (with a secret) and drops state of older iterations never collected."""
        if self._base is not None and iteration <= self._base:
            return
        self._base = iteration
        for old in [k for k in self._open if k < iteration and k not in self._waiters]:
            del self._open[old]
        last = iteration + TOKEN_WINDOW - 1
        if self.tokens.enabled and last > self._installed:
            first = max(iteration, self._installed + 1)
            self._aggregator.install_tokens([(w, k, self.tokens.worker(w, k)) for k in range(first, last + 1)
                                             for w in range(self.workers)])
        self._installed = max(self._installed, last)

    async def wait_workers(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return once every expected worker has said HELLO."""
        try:
            async with asyncio.timeout(timeout):
                while len(self.addresses) < self.workers:
                    self._hello.clear()
                    await self._hello.wait()
        except TimeoutError:
            missing = sorted(set(range(self.workers)) - set(self.addresses))
            raise EdgeTimeout(f"edge gateway: workers {missing} never said HELLO within {timeout} s") from None

    async def collect(self, iteration: int, *, timeout: float) -> list[np.ndarray]:  # noqa: ASYNC109
        """The LAN sum of every tensor for ``iteration`` (float32); EdgeTimeout names missing workers."""
        self.expect(iteration)
        sums = self._sums(iteration)
        waiter = self._waiters.setdefault(iteration, asyncio.Event())
        deadline = time.monotonic() + timeout
        try:
            while not sums.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EdgeTimeout(f"edge gateway: iteration {iteration} incomplete after {timeout} s: "
                                      f"{sums.describe_missing()}")
                waiter.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 4 * self.slot_timeout)):
                        await waiter.wait()
                if not sums.done and not waiter.is_set():
                    await self._poke_stalled(sums)
            return sums.result()
        finally:
            self._waiters.pop(iteration, None)
            self._open.pop(iteration, None)
            self._finished[iteration] = sums
            for old in [k for k in self._finished if k < iteration - 4]:
                del self._finished[old]

    async def send_results(self, iteration: int, results: Sequence[np.ndarray], *, total: int,
                           unicast: bool = False) -> None:
        """Queue for every worker the float32 result of each chunk, a sum over ``total`` workers (the node's
        contributor count), once to the multicast group (``unicast``, or without a group: a copy to each
        worker, as for the first result, which a worker may be asked for before it joined the group);
        kept for PULLs until 4 iterations later. Returns once queued: the send task paces the burst
        (bpf/outbox.py), one batch per destination in turn, so a worker whose copy leaves slowly delays
        only its own."""
        self.expect(iteration + 1)   # the workers' next DATA
        rows = np.concatenate([result_packets(self.layout, job=self.job, iteration=iteration, tensor=t,
                                              values=np.asarray(r, np.float32), total=total)
                               for t, r in enumerate(results)])
        self._results[iteration] = rows
        for old in [k for k in self._results if k < iteration - 4]:
            del self._results[old]
        self.outbox.forget(iteration - 4)
        absent = [w for w in range(self.workers) if w not in self.addresses]
        if self.group is not None and not unicast:
            # one copy of each datagram; the LAN replicates it to every member of the group
            mine = with_token(rows, self.tokens.group(iteration)) if self.tokens.enabled else rows
            self.outbox.bulk(mine, self.group, tag=iteration)
        else:
            for w in range(self.workers):
                address = self.addresses.get(w)
                if address is None:
                    continue
                mine = with_token(rows, self.tokens.gateway(w, iteration)) if self.tokens.enabled else rows
                self.outbox.bulk(mine, address, tag=iteration)
        self._wake.set()
        if absent:
            raise EdgeTimeout(f"edge gateway: iteration {iteration}: no address for workers {absent} (never said "
                              "HELLO); the others got their results")

    # ------------------------------------------------------------------ internals
    def _sums(self, iteration: int) -> IterationSums:
        sums = self._open.get(iteration)
        if sums is None:
            sums = IterationSums(self.layout, iteration, self.workers, self.job)
            self._open[iteration] = sums
        return sums

    def _accepts(self, iteration: int) -> bool:
        """Whether datagrams of ``iteration`` may create or touch its sums: only iterations of the window
        (so nothing a stray datagram names allocates beyond it)."""
        if iteration in self._open:
            return True
        if iteration in self._finished:
            return False
        if self._base is None:
            return len(self._open) < TOKEN_WINDOW
        return 0 <= iteration - self._base < TOKEN_WINDOW

    def _stamp(self, datagram: bytes, worker: int) -> bytes:
        """``datagram`` with ``worker``'s gateway token for the iteration it names."""
        if not self.tokens.enabled:
            return datagram
        iteration = int.from_bytes(datagram[_ITERATION_AT: _ITERATION_AT + 4], "little")
        token = self.tokens.gateway(worker, iteration).to_bytes(8, "little")
        return datagram[:TOKEN_AT] + token + datagram[TOKEN_AT + 8:]

    def _control(self, datagram: bytes, address: Address) -> bool:
        """Queue a control datagram for the send task; False when the queue is full (the protocol repeats
        it: a NACK timer fires again, a worker asks again)."""
        self._wake.set()
        return self.outbox.control(datagram, address)

    def _emit(self, actions: list[tuple[int, bytes]]) -> None:
        for worker, datagram in actions:
            address = self.addresses.get(worker)
            if address is None:
                log.warning("edge gateway: cannot NACK worker %d: no HELLO yet", worker)
                continue
            if not self._control(self._stamp(datagram, worker), address):
                log.warning("edge gateway: send queue full, NACK to worker %d dropped (the timer repeats it)", worker)

    async def _poke_stalled(self, sums: IterationSums) -> None:
        """A slot can complete while its AGG datagram is lost before our socket: a duplicate from one
        contributor makes the aggregator re-emit it. Pending slots that are merely incomplete are
        unaffected (the duplicate is dropped) and stay with the timer."""
        for t, c in sorted(sums.pending)[:256]:
            nack = control_packet(Kind.NACK, job=self.job, worker=0, iteration=sums.iteration, tensor=t, chunk=c,
                                  slot=self.layout.slot(t, c), scale=self.layout.scales[t])
            address = self.addresses.get(0)
            if address is not None:
                self._control(self._stamp(nack, 0), address)

    def _on_agg(self, data: bytes) -> None:
        started = time.thread_time()
        try:
            self._take_agg(data)
        finally:
            self.delivery_cpu += time.thread_time() - started

    def _take_agg(self, data: bytes) -> None:
        head = Header.decode(data)
        if self.agg_token and head.token != self.agg_token:
            self.forged += 1
            return
        if head.job != self.job:
            return
        if not self._accepts(head.iteration):
            if head.iteration in self._finished:   # a re-emitted aggregate: its ACK was lost, say it again
                self._ack(head.iteration, self.layout.seq(head.tensor, head.chunk))
            return
        sums = self._sums(head.iteration)
        self._emit(sums.on_agg(head, lanes_of(data)))
        if (head.tensor, head.chunk) not in sums.pending:
            self._ack(head.iteration, self.layout.seq(head.tensor, head.chunk))
        if sums.done:
            waiter = self._waiters.get(head.iteration)
            if waiter is not None:
                waiter.set()

    def _ack(self, iteration: int, seq: int) -> None:
        self._acks.setdefault(iteration, []).append(seq)

    def _flush_acks(self) -> None:
        """Send the ACKs gathered while handling a batch of datagrams: one multicast datagram per 256
        chunks (or a unicast copy per worker without a group)."""
        acks, self._acks = self._acks, {}
        for iteration, seqs in acks.items():
            if self.group is not None:
                targets = [(self.group, self.tokens.group(iteration))]
            else:
                targets = [(address, self.tokens.gateway(w, iteration)) for w, address in self.addresses.items()]
            for datagram in ack_packets(np.asarray(seqs), job=self.job, iteration=iteration):
                for address, token in targets:
                    stamped = datagram[:TOKEN_AT] + token.to_bytes(8, "little") + datagram[TOKEN_AT + 8:]
                    self.acks_sent += 1
                    self._control(stamped, address)

    def _answer_query(self, head: Header, data: bytes, address: Address) -> None:
        """A worker asks which of its unacknowledged chunks completed (its ACKs may have been lost)."""
        seqs = np.frombuffer(data, "<u4", count=head.count, offset=HEADER_BYTES)
        sums = self._open.get(head.iteration)
        if sums is not None:
            done = [int(q) for q in seqs if q < self.layout.num_chunks and self.layout.locate(int(q)) not in
                    sums.pending]
        elif head.iteration in self._finished:
            done = [int(q) for q in seqs]
        else:
            return
        token = self.tokens.gateway(head.worker, head.iteration)
        for datagram in ack_packets(np.asarray(done), job=self.job, iteration=head.iteration):
            stamped = datagram[:TOKEN_AT] + token.to_bytes(8, "little") + datagram[TOKEN_AT + 8:]
            self._control(stamped, address)

    def deployment(self, worker: int, *, aggregator: bool = False) -> Deployment | None:
        """What ``worker`` is told in the answer to its HELLO (None: not yet known, its aggregator has not
        said HELLO; the worker asks again)."""
        head = self.topology.aggregator_of(worker)
        send_to: tuple[str, int] | None = None
        if head is not None and not aggregator:
            found = self._aggregators.get(head)
            if found is None:
                return None
            send_to = (found[0], self.sock.getsockname()[1])
        members = self.topology.clusters.get(worker, ()) if aggregator else ()
        return Deployment(pool=self.layout.num_slots, lanes=self.layout.lanes, scale=self.layout.scales[0],
                          send_to=send_to, group=self.group, members=tuple(members), retransmit=self.retransmit,
                          first_iteration=self._base)

    def _on_events(self, events: list[SlotEvent]) -> None:
        for event in events:
            if event.job != self.job or not self._accepts(event.iteration):
                continue
            self._emit(self._sums(event.iteration).on_event(event))

    def _on_ring(self) -> None:
        assert self.xdp is not None
        self._on_events(self.xdp.drain_events())
        if self._acks:
            self._flush_acks()

    def _handle(self, data: bytes, address: Address) -> None:
        kind = data[KIND_AT] if len(data) >= HEADER_BYTES else 0
        if kind == Kind.AGG:
            if self.fallback is not None:   # the userspace aggregator hands its aggregates over directly
                raise WireError(f"AGG datagram from {address}: only the XDP data plane makes them")
            self._on_agg(data)
        elif kind == Kind.DATA and self.fallback is not None:
            now = time.monotonic()
            self._measure(data, now)
            agg = self.fallback.on_data(data, now)
            if agg is not None:
                self._on_agg(agg)
        else:
            head = Header.decode(data)
            if head.job != self.job:
                raise WireError(f"datagram of job {head.job}, this gateway serves job {self.job}")
            if head.kind in (Kind.HELLO, Kind.PULL, Kind.QUERY) and head.worker >= self.workers:
                raise WireError(f"{head.kind.name} from worker {head.worker}: this gateway serves workers "
                                f"0..{self.workers - 1}")
            # a PULL for a result we do not keep has no answer: dropped before any token is derived for it
            rows = self._results.get(head.iteration) if head.kind == Kind.PULL else None
            if head.kind == Kind.PULL and rows is None:
                return
            if head.kind == Kind.QUERY and head.iteration not in self._open and head.iteration not in self._finished:
                return
            # HELLO nonces are the sender's choice: their tokens are derived, never cached
            if head.kind in (Kind.HELLO, Kind.PULL, Kind.QUERY) and not self.tokens.valid(
                    Sender.WORKER, head.worker, head.iteration, head.token, keep=head.kind != Kind.HELLO):
                self.forged += 1
                raise WireError(f"{head.kind.name} as worker {head.worker} from {address} with a wrong token")
            if head.kind == Kind.HELLO:
                self._on_hello(head, data, address)
            elif head.kind == Kind.QUERY:
                self._answer_query(head, data, address)
            elif head.kind == Kind.PULL:
                if rows is not None:
                    # results are kept one row per chunk of the model (its sequence number), not per pool
                    # slot: with a pool smaller than the model the slot names several chunks
                    index = self.layout.seq(head.tensor, head.chunk)
                    row = rows[index: index + 1]
                    if self.tokens.enabled:
                        row = with_token(row, self.tokens.gateway(head.worker, head.iteration))
                    # with that worker's other bulk: a slow worker's PULLs wait behind its own backlog
                    self.outbox.bulk(row, address, tag=head.iteration)
                    self._wake.set()
            elif head.kind == Kind.DATA and head.precision != Precision.FIXED32 and self.xdp is not None:
                # narrow lanes the program could not widen in place: widened here, aggregated there
                verdict, out = self.xdp.run_widened(data)
                if verdict == XDP_PASS and len(out) >= HEADER_BYTES and out[KIND_AT] == Kind.AGG:
                    self._on_agg(out)
            elif head.kind == Kind.DATA:
                raise WireError(f"DATA from worker {head.worker} reached the agent in xdp mode (malformed?)")
            else:
                raise WireError(f"unexpected {head.kind.name} datagram from {address}")

    def _measure(self, data: bytes, now: float) -> None:
        """Count a DATA datagram towards its worker's achieved uplink (bpf/uplinks.py), read straight from the
        header words (the aggregator validates the datagram itself)."""
        iteration = int.from_bytes(data[_ITERATION_AT: _ITERATION_AT + 4], "little")
        if not self._accepts(iteration):
            return
        tensor = int.from_bytes(data[_TENSOR_AT: _TENSOR_AT + 4], "little")
        chunk = int.from_bytes(data[_CHUNK_AT: _CHUNK_AT + 4], "little")
        if tensor >= len(self.layout.sizes) or chunk >= self.layout.chunks[tensor]:
            return
        worker = data[_WORKER_AT]
        self.uplinks.on_data(worker, iteration, self.layout.first_slot[tensor] + chunk, len(data), now)

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        """Each worker's first window of ``iteration`` as (worker, bytes, first, last arrival); empty in XDP
        mode, where DATA never reaches the agent."""
        return self.uplinks.close(iteration)

    def _on_hello(self, head: Header, data: bytes, address: Address) -> None:
        """Bind the worker to the address its (authenticated) HELLO came from, so a restarted worker is
        found again; ``iteration`` carries the worker's nonce, and with a secret a nonce already seen from
        another address is a replay and refused. A HELLO flagged AGGREGATOR comes from a cluster
        aggregator's service: its address becomes where the cluster's members send DATA. The answer carries
        the worker's deployment; a member whose aggregator has not said HELLO yet gets none (it asks again)."""
        seen = self._nonces.setdefault(head.worker, deque(maxlen=HELLO_NONCES))
        bound = self._aggregators if head.flags & Flag.AGGREGATOR else self.addresses
        if self.tokens.enabled and head.iteration in seen and bound.get(head.worker) != address:
            self.forged += 1
            raise WireError(f"HELLO as worker {head.worker} from {address} replays an earlier nonce")
        if head.iteration not in seen:
            seen.append(head.iteration)
        aggregator = bool(head.flags & Flag.AGGREGATOR)
        if aggregator and head.worker not in self.topology.clusters:
            raise WireError(f"aggregator HELLO from worker {head.worker}, which aggregates no cluster here")
        deployment = self.deployment(head.worker, aggregator=aggregator)
        if deployment is None:
            return
        bound[head.worker] = address
        if not aggregator:
            self._hello.set()
        # the answer tells the worker our layout (tensors, chunks) and scale, so it can check its own
        reply = control_packet(Kind.HELLO, job=self.job, worker=head.worker, iteration=head.iteration,
                               tensor=len(self.layout.sizes), chunk=self.workers, slot=self.layout.num_chunks,
                               scale=self.layout.scales[0], flags=head.flags & Flag.AGGREGATOR,
                               token=self.tokens.of(Sender.GATEWAY, head.worker, head.iteration, keep=False))
        self._control(reply + deployment.encode(), address)

    def _drain(self) -> None:
        """Handle what is queued on the socket (up to 256 datagrams per wake-up; the kernel keeps the rest)."""
        started = time.thread_time()
        buf, view = self._buf, self._view
        for _ in range(256):
            try:
                n, address = self.sock.recvfrom_into(buf)
            except BlockingIOError:
                break
            try:
                self._handle(bytes(view[:n]), address)
            except WireError as exc:
                self.errors += 1
                log.warning("edge gateway: rejected datagram from %s: %s", address, exc)
        if self._acks:
            self._flush_acks()
        self.receive_cpu += time.thread_time() - started

    async def _timers(self) -> None:
        assert self.fallback is not None
        while True:
            deadline = self.fallback.next_deadline()
            delay = self.slot_timeout if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.sleep(min(delay, self.slot_timeout))
            self._on_events(self.fallback.expire(time.monotonic()))
