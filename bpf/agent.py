"""The gateway's edge agent: turns completed slots into per-iteration LAN sums, NACKs missing workers,
recovers overflow by re-quantisation, and hands results back to the workers.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bpf.fallback import UserspaceAggregator
from bpf.outbox import Outbox
from bpf.uplinks import UplinkTracker
from bpf.writer import SocketWriter
from bpf.xdp import (
    GROUP_TOKENS,
    ITERATION_DONE,
    TOKEN_WINDOW,
    XDP_PASS,
    XDP_TX,
    KernelResults,
    SlotEvent,
    XdpAggregator,
    multicast_mac,
)
from netstorm.errors import NetStormError
from netstorm.lan import udp
from netstorm.lan.batch import DatagramBatch, copy_rows, distinct, valid_headers
from netstorm.lan.deploy import Deployment, LanTopology
from netstorm.lan.downlink import DownlinkReports, parse_report
from netstorm.lan.errors import (
    EdgeTimeout,
    IntegerOverflow,
    IterationAborted,
    ServicesMissing,
    StaleDeployment,
    WireError,
)
from netstorm.lan.fixedpoint import dequantize_rows, rescale_for
from netstorm.lan.header import (
    HEADER_BYTES,
    KIND_AT,
    MAX_WORKERS,
    OFFSETS,
    TOKEN_AT,
    Flag,
    Header,
    Kind,
    Precision,
    lanes_of,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import (
    ack_packets,
    chunk_results_into,
    cluster_nack_packet,
    control_packet,
    nack_packets,
    result_packets,
    set_epoch,
    with_token,
)
from netstorm.lan.prefault import populated
from netstorm.lan.redeploy import Redeployment, Switch
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.tokens import LanTokens, Sender

log = logging.getLogger(__name__)
Address = tuple[str, int]
RECEIVE_BATCH = 256
"""Datagrams taken per wake-up (the rest stay queued in the kernel for the next)."""
GAP_CHUNKS = 1
"""How far below the highest completed chunk an open one must be before the agent NACKs its missing workers
unasked. One suffices: a worker's datagrams reach the aggregator in the order it sent them (one flow, one
queue), so a completed chunk means every worker's earlier chunks arrived or were lost; aggregates of chunks
completed together may reach the agent out of order, but the slot read decides (a slot that did complete
has no missing worker, and nobody is NACKed)."""
QUERY_LIMIT = 256
CLUSTER_NACK_HOLD = 0.02
"""Least time between two NACKs of one chunk to one cluster aggregator (the hold is also at least the workers'
``retransmit`` and the slot timers' period): the gap rule, the slot timers and every member's QUERY may name
the same chunk, and the aggregator answers each by NACKing its missing members, who resend at most once per
round trip anyway; on a shaped LAN a NACK per chunk and QUERY filled the gateway's control queue."""
"""Chunks of one QUERY the agent looks at (a worker asks about at most this many per datagram)."""
HELLO_NONCES = 16
"""HELLO nonces remembered per worker: a replayed HELLO from another address is refused."""
_AGG = int(Kind.AGG)
_DATA = int(Kind.DATA)
_OVERFLOW = int(Flag.OVERFLOW)
"""Codes compared per batch, looked up once (an enum member's look-up costs more than the comparison)."""
_ITERATION_AT = OFFSETS["iteration"]
_EPOCH_AT = OFFSETS["epoch"]
_WORKER_AT = OFFSETS["worker"]
_TENSOR_AT = OFFSETS["tensor"]
_CHUNK_AT = OFFSETS["chunk"]
KEEP_MODELS = 8
"""Models' worth of bulk (result copies, PULL answers) the outbox holds per destination."""
KEEP_FAILED = 8
"""Failed iterations remembered, so a worker's PULL or QUERY about one is answered with FAILED."""


@dataclass
class IterationSums:
    """One iteration's LAN sums, filled chunk by chunk from AGG datagrams.

    Each completed slot's int32 lanes and scale are stored as they come (one row copy per datagram, or one
    fancy-indexed copy per batch of them, ``take``); the conversion to floats runs once per tensor,
    vectorised, when the iteration is complete. Which chunks are still pending is a mask over the
    model's chunk sequence numbers."""

    layout: EdgeLayout
    iteration: int
    workers: int
    job: int
    missing: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    rescaled: int = 0
    integer: bool = False
    """The lanes are exact integers at scale 0 (a compressed job's round, ``netstorm/lan/introunds.py``): an
    overflow fails the iteration (``failure``) instead of re-quantising, which would not be exact."""
    lanes_kept: bool = True
    """False where the aggregation program returns results itself (``EdgeAgent.return_results_from_kernel``):
    the agent then sees only overflowed slots and slot reports, so no model-sized rows are kept."""
    failure: NetStormError | None = None
    """Why the iteration ends without sums: an integer overflow, or the node failed it (``EdgeAgent.fail``)."""
    on_complete: Callable[[np.ndarray], None] | None = None
    """Called with the sequence numbers of the chunks each aggregate (or batch of them) completed, as they
    complete: how a result can leave chunk by chunk (``EdgeAgent.stream_results``)."""
    watchers: list[Callable[[np.ndarray], None]] = field(default_factory=list)
    """Called like ``on_complete``: how the gateway hands the node each part of a tensor as soon as the LAN
    chunks under it are summed (``EdgeAgent.watch``)."""

    def __post_init__(self) -> None:
        self.open = np.ones(self.layout.num_chunks, bool)
        """Chunks (by sequence number) whose aggregate has not arrived."""
        self.remaining = self.layout.num_chunks
        self.highest = 0
        """One past the highest chunk completed."""
        self.gap_checked = 0
        """Chunks below this were looked at for a gap once (``EdgeAgent._nack_gaps``)."""
        self.cluster_nacked = np.full(self.layout.num_chunks, -np.inf)
        """When each chunk was last NACKed to a cluster aggregator (``EdgeAgent._nack_clusters``)."""
        self.first_at = float("inf")
        self.done_at = float("inf")
        """When the first chunk completed and when the last did (monotonic clock; the gateway logs the LAN
        phase of each iteration from them)."""
        self.raw = (populated((self.layout.num_chunks, self.layout.lanes), np.int32) if self.lanes_kept
                    else np.zeros((0, self.layout.lanes), np.int32))
        """Each chunk's exact sum, a row written when the chunk completes and read only after (lanes past a
        tensor's end are whatever the aggregate carried there: ``result``, ``part`` and the RESULT datagrams
        leave them out), so it is not cleared first; its pages are mapped at once (``populated``), not faulted
        in chunk by chunk."""
        self.scales = np.zeros(self.layout.num_chunks, np.int64)
        self._sizes = np.asarray(self.layout.sizes, np.int64)

    @property
    def done(self) -> bool:
        return not self.remaining

    @property
    def pending(self) -> set[tuple[int, int]]:
        """(tensor, chunk) of every chunk still pending."""
        return {self.layout.locate(int(q)) for q in np.flatnonzero(self.open)}

    def is_pending(self, tensor: int, chunk: int) -> bool:
        """Whether (tensor, chunk) is a chunk of the layout whose aggregate has not arrived."""
        if not 0 <= tensor < len(self.layout.sizes) or not 0 <= chunk < self.layout.chunks[tensor]:
            return False
        return bool(self.open[self.layout.first_slot[tensor] + chunk])

    def _complete(self, seqs: np.ndarray) -> None:
        fresh = distinct(seqs[self.open[seqs]])
        if fresh.size:
            self.highest = max(self.highest, int(fresh[-1]) + 1)
        self.open[fresh] = False
        self.remaining -= int(fresh.size)
        self._stamp_progress()
        if self.missing:
            for q in fresh:
                self.missing.pop(self.layout.locate(int(q)), None)
        if fresh.size:
            self._notify(fresh)

    def _notify(self, seqs: np.ndarray) -> None:
        if self.on_complete is not None:
            self.on_complete(seqs)
        for watcher in self.watchers:
            watcher(seqs)

    def _stamp_progress(self) -> None:
        now = time.monotonic()
        self.first_at = min(self.first_at, now)
        if not self.remaining:
            self.done_at = min(self.done_at, now)

    def on_agg(self, head: Header, lanes: np.ndarray) -> list[tuple[int, bytes]]:
        """Take a completed slot; an overflowed one yields RESCALE NACKs to every worker instead."""
        if not self.is_pending(head.tensor, head.chunk):
            return []
        if head.flags & Flag.OVERFLOW and self.integer:
            self.failure = IntegerOverflow(
                f"iteration {self.iteration} tensor {head.tensor} chunk {head.chunk}: the integer lanes' sum left "
                f"int32 (flagged OVERFLOW by the aggregator); integer rounds are not re-quantised")
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
        self.open[row] = False          # one chunk: scalar updates (this runs per aggregate in userspace mode)
        self.remaining -= 1
        self._stamp_progress()
        self.highest = max(self.highest, int(row) + 1)
        self.missing.pop((head.tensor, head.chunk), None)
        if self.on_complete is not None or self.watchers:
            self._notify(np.array([row], np.int64))
        return []

    def take(self, heads: np.ndarray, lanes: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Take many aggregates at once (``heads``: their headers, valid and without OVERFLOW; ``lanes``: int32
        lanes, one row per aggregate, or with ``rows`` the rows of a whole received batch, ``rows`` naming
        each aggregate's, so only the lanes taken are copied, once): the sequence numbers of every one naming
        a chunk of the layout with its exact lane count (completed now or before, so each is ACKed), and how
        many did not."""
        seq, known = self.layout.seqs(heads["tensor"], heads["chunk"])
        tensor = np.where(known, heads["tensor"].astype(np.int64), 0)
        chunk = heads["chunk"].astype(np.int64)
        known &= heads["count"] == np.minimum(self.layout.lanes, self._sizes[tensor] - chunk * self.layout.lanes)
        index = np.flatnonzero(known)
        seq = seq[index]
        new = self.open[seq]
        taken = seq[new]
        index = index[new]
        # lanes past a tensor's last element are padding: result() cuts them off
        copy_rows(self.raw, taken, lanes[:, : self.layout.lanes], index if rows is None else rows[index])
        self.scales[taken] = heads["scale"][index]
        self._complete(taken)
        return seq, int(known.size - seq.size)

    def on_event(self, event: SlotEvent) -> tuple[int, list[int]] | None:
        """A slot report (a timer's, or the program's gap rule): the chunk's sequence number and exactly the
        workers it says are missing, to NACK (None: the chunk is no longer pending)."""
        key = (event.tensor, event.chunk)
        if not self.is_pending(*key):
            return None
        self.missing[key] = event.missing
        return self.layout.seq(*key), event.missing

    def result(self) -> list[np.ndarray]:
        """Every tensor's sum: exact int32 lanes times 2**-scale, rounded once to float32 (``dequantize_rows``)."""
        out = []
        for t, size in enumerate(self.layout.sizes):
            rows = slice(self.layout.first_slot[t], self.layout.first_slot[t] + self.layout.chunks[t])
            out.append(dequantize_rows(self.raw[rows], self.scales[rows]).reshape(-1)[:size])
        return out

    def part(self, tensor: int, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``tensor``'s sum, every chunk under them complete: exactly what
        ``result`` holds there (the same exact lanes, scaled and rounded once)."""
        lanes = self.layout.lanes
        first = self.layout.first_slot[tensor]
        rows = slice(first + start // lanes, first + -(-stop // lanes))
        if np.any(self.open[rows]):
            raise ValueError(f"iteration {self.iteration} tensor {tensor} [{start}, {stop}): a chunk is not summed")
        block = dequantize_rows(self.raw[rows], self.scales[rows])
        skip = start - (start // lanes) * lanes
        return block.reshape(-1)[skip: skip + stop - start].copy()

    def first_pending(self, n: int) -> list[tuple[int, int]]:
        """(tensor, chunk) of the first ``n`` pending chunks, in model order."""
        return [self.layout.locate(int(q)) for q in np.flatnonzero(self.open)[:n]]

    def describe_missing(self) -> str:
        shown = self.first_pending(5)
        parts = [f"tensor {t} chunk {c} missing workers {self.missing.get((t, c), 'unknown (no report yet)')}"
                 for t, c in shown]
        more = f" and {self.remaining - len(shown)} more" if self.remaining > len(shown) else ""
        return "; ".join(parts) + more


@dataclass
class _Stream:
    """An iteration whose result leaves chunk by chunk (``EdgeAgent.stream_results``)."""

    sums: IterationSums
    total: int
    unicast: bool
    rows: np.ndarray
    """RESULT datagrams, one row per chunk of the model, filled as the chunks complete (PULLs are answered
    from here)."""
    sent: np.ndarray
    """Chunks whose result went out."""
    due: list[np.ndarray] = field(default_factory=list)
    """Sequence numbers completed since the last flush (one result burst per batch of datagrams)."""


class EdgeAgent:
    """The asyncio agent on the gateway's UDP port: drives the XDP aggregator (its ring buffer) or the
    userspace one (fed DATA here), and answers the LAN workers."""

    def __init__(self, sock: socket.socket, layout: EdgeLayout, *, workers: int, job: int, mode: str,
                 xdp: XdpAggregator | None = None, slot_timeout: float = 0.2, max_nacks: int = 20,
                 secret: bytes | None = None, group: tuple[str, int] | None = None,
                 topology: LanTopology | None = None, retransmit: float = 0.005, query_nacks: bool = True) -> None:
        """``layout`` fixes the pool (``layout.pool``) and lanes per datagram; ``group`` is the multicast
        (address, port) for ACKs and results (None: a unicast copy per worker); ``topology`` says which
        workers aggregate which (None: one level); ``retransmit`` is what workers are told to wait for
        progress before resending; ``query_nacks`` tells them to ask before resending and answers a QUERY
        with NACKs to exactly the workers missing from each incomplete chunk's slot."""
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
        self.query_nacks = query_nacks
        self.pace_gbit: dict[int, float] = {}
        """Per worker, the Gbit/s its DATA is paced to (its HELLO answer says; the DC's plan, with
        ``dc_pace_rates``); a worker not listed is unpaced."""
        self.query_nacks_sent = 0
        """(worker, chunk) pairs NACKed to unclustered workers missing from a slot, in answer to a QUERY or
        from the agent's own gap rule."""
        self.nack_datagrams = 0
        """NACK datagrams those went out in (one per worker and wake-up, up to 256 chunks each)."""
        self._nacks: dict[tuple[int, int], list[np.ndarray]] = {}
        """Chunks to NACK per (iteration, worker), gathered over one wake-up (``_flush_nacks``)."""
        self.cluster_nacks_sent = 0
        """NACKs to a cluster aggregator's service for a chunk its aggregate is missing from (any cause)."""
        self.expected = self.topology.gateway_mask()
        self.deployments = Redeployment(self.topology, hold=max(2 * retransmit, 0.01))
        """The deployment's epoch and its changes at iteration boundaries (netstorm/lan/redeploy.py)."""
        self.moved_sent = 0
        """MOVED sent: to aggregator services at a switch, and to senders behind (``stale_told``)."""
        self.stale_told = 0
        """MOVED to a sender whose DATA carried an old epoch, or who was to be NACKed before it asked for the
        current deployment."""
        self._hello_epoch: dict[int, int] = {}
        """Worker -> the epoch of its latest answered HELLO (the deployment it was told)."""
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
        self.downlinks = DownlinkReports(workers)
        """Each worker's result bursts as its REPORTs say (netstorm/lan/downlink.py): its achieved downlink."""
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
        self._results: dict[int, tuple[EdgeLayout, list[np.ndarray]]] = {}
        """iteration -> its result's chunk layout and each tensor's RESULT datagrams (kept for PULLs), two
        blocks per tensor: its chunks but the last, then its last (``_trimmed``)."""
        self._streams: dict[int, _Stream] = {}
        """Iterations whose result is the LAN's own sum, sent chunk by chunk as the chunks complete."""
        self.streamed_chunks = 0
        """Result chunks sent before their iteration was complete (``stream_results``)."""
        self.receive_cpu = 0.0
        """Thread CPU seconds spent receiving and handling datagrams (not sending: no result broadcast)."""
        self.delivery_cpu = 0.0
        """Part of receive_cpu spent taking completed slots into the iteration's sums (same in both modes)."""
        self.errors = 0
        self._tasks: asyncio.TaskGroup | None = None
        self._stop = asyncio.Event()
        self._rx = DatagramBatch(RECEIVE_BATCH)
        self.gia_threshold = 0
        """A FediAC job's threshold the WAN roots apply (told to every worker in its deployment)."""
        self._wires: dict[int, tuple[EdgeLayout, bool, ResultWire]] = {}
        """iteration -> its own layout, whether its lanes are exact integers, and how its result goes back,
        where one was planned."""
        self.failed: dict[int, str] = {}
        """The newest iterations the node failed (``fail``), and why."""
        self.kernel_results = False
        """The aggregation program returns each chunk's result to the workers itself
        (``return_results_from_kernel``); the agent handles slot reports and overflow only."""
        self._done_through: int | None = None
        """The newest iteration every chunk of which completed in the program (its ring-buffer reports);
        iterations complete in order (one needs every worker to have had all of the one before)."""

    def return_results_from_kernel(self, own_mac: bytes) -> None:
        """From now on the XDP program sends each completed slot back to the workers' multicast group itself
        (ALEPH's result path, ``edge_results=kernel``): nothing of a chunk's sum crosses into userspace, and
        the agent handles only slot reports (NACKs), overflowed slots (RESCALE) and HELLOs. The result is then
        the LAN's own sum, as in a job of one DC or this benchmark; a gateway that needs the sum for its WAN
        step keeps the agent's path. Needs the xdp mode, a multicast group and a layout with shadow slots
        (``EdgeLayout.shadow``): no copy of a result is kept to answer a worker that lost it, so the slot
        itself must last until every worker has it (the worker resends its DATA, and the program sends the
        slot's result again). Everything the program needs is the agent's own (its group, address, workers and
        layout) but ``own_mac``, the gateway interface's link-layer address the results leave from."""
        if self.mode != "xdp" or self.xdp is None:
            raise ValueError("results return from the kernel only on the xdp path")
        if self.addresses or self._wires:
            raise ValueError("results from the kernel are chosen before any worker says HELLO or a round is planned")
        if self.group is None:
            raise ValueError("results return from the kernel to a multicast group: configure edge_group")
        if not self.layout.shadow:
            raise ValueError("results from the kernel need a layout with shadow slots (EdgeLayout.shadow)")
        host, port = self.sock.getsockname()[:2]
        self.xdp.return_results(KernelResults(group=self.group, group_mac=multicast_mac(self.group[0]),
                                              own=(host, port), own_mac=own_mac, total=self.workers,
                                              chunks=self.layout.num_chunks))
        self.kernel_results = True
        if self.tokens.enabled and self._base is not None:
            self._aggregator.install_tokens([(GROUP_TOKENS, k, self.tokens.group(k))
                                             for k in range(self._base, self._installed + 1)])

    async def completed(self, iteration: int, *, timeout: float) -> None:  # noqa: ASYNC109
        """Return once the program has sent the result of every chunk of ``iteration`` (results from the
        kernel); EdgeTimeout names the chunks still missing workers, as the slot reports said."""
        if not self.kernel_results:
            raise ValueError("completed() waits for results the program returns itself; use collect()")
        assert self.xdp is not None
        if self._base is None:
            self.expect(iteration)
        # the window moves only on the program's reports (``_on_done``): a caller already waiting for the next
        # iteration must not take the tokens of one whose lost results are still being sent again
        waiter = self._waiters.setdefault(iteration, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                while not self._done(iteration):
                    waiter.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(4 * self.slot_timeout):
                            await waiter.wait()
                    if not self._done(iteration) and self.xdp.completed_chunks(iteration) >= self.layout.num_chunks:
                        self._on_done(iteration)   # its report was lost (a full ring buffer): the count says so
        except TimeoutError:
            sums = self._open.get(iteration)
            missing = sums.describe_missing() if sums is not None and sums.missing else "no slot report yet"
            raise EdgeTimeout(f"edge gateway: iteration {iteration}: the program has not returned every result "
                              f"after {timeout} s: {missing}") from None
        finally:
            self._waiters.pop(iteration, None)
            self._open.pop(iteration, None)

    def _done(self, iteration: int) -> bool:
        """Whether ``iteration`` completed in the program (iterations compared modulo 2**32)."""
        if self._done_through is None:
            return False
        return ((self._done_through - iteration) & 0xFFFFFFFF) < 2**31

    def _on_done(self, iteration: int) -> None:
        """Every chunk of ``iteration`` completed in the program. The token window then starts at it, not at
        the next: a worker that lost one of its results still resends its DATA (the program sends the result
        again), so its tokens stay installed until the next iteration completes too, which no worker's DATA
        can do before that worker had every result of this one. The next iteration is inside the window."""
        if self._done(iteration):
            return
        self._done_through = iteration
        self.expect(iteration)
        waiter = self._waiters.get(iteration)
        if waiter is not None:
            waiter.set()

    def plan(self, iteration: int, layout: EdgeLayout, *, integer: bool = False,
             back: ResultWire | None = None) -> None:
        """Iteration ``iteration`` travels on ``layout`` instead of the model's (a compressed job's round
        carries only the lanes with data, ``netstorm/lan/introunds.py``) and its result goes back as ``back``
        says (None: float32 lanes on ``layout``); planned before its first datagram can arrive, i.e. before
        the previous iteration's results are sent. Its lanes and pool must fit the aggregator loaded for the
        model's layout."""
        if self.kernel_results:
            raise ValueError("a planned round's result is the agent's to send: not with results from the kernel")
        if layout.lanes != self.layout.lanes or layout.num_slots > self.layout.num_slots:
            raise ValueError(f"iteration {iteration}: a layout of {layout.lanes} lanes and {layout.num_slots} slots "
                             f"does not fit the aggregator's {self.layout.lanes} lanes and {self.layout.num_slots}")
        self._wires[iteration] = (layout, integer, ResultWire.float32(layout) if back is None else back)
        for old in [k for k in self._wires if k < iteration - 8]:
            del self._wires[old]

    @property
    def epoch(self) -> int:
        """The current deployment epoch (what DATA must carry, and what results announce)."""
        return self.deployments.epoch

    def redeploy(self, topology: LanTopology, iteration: int) -> Switch | None:
        """Run ``topology`` from iteration ``iteration + 1`` on, under the next epoch; called as the result of
        ``iteration`` is released, before it is sent (its datagrams announce the epoch). The aggregator's
        expected contributors and epoch are rewritten in place (the XDP program's configuration map, or the
        fallback's fields), and every aggregator service that said HELLO is sent MOVED, so it asks for its
        part before its members send. None when ``topology`` is the running one; ServicesMissing (nothing
        changed) when it names an aggregator whose service never said HELLO."""
        if self.kernel_results:
            raise ValueError("a live re-deployment switches at the node's release of a result: not with results "
                             "from the kernel")
        if topology.workers != self.workers:
            raise ValueError(f"a topology of {topology.workers} workers for a gateway of {self.workers}")
        if not self.deployments.propose(topology):
            return None
        absent = self.services_missing(topology)
        if absent:
            self.deployments.propose(self.topology)   # nothing pending here: the caller keeps the plan
            raise ServicesMissing(f"edge gateway: the aggregator services of workers {absent} never said HELLO; "
                                  f"a deployment naming them waits for them")
        switch = self.deployments.released(iteration)
        if switch is None:
            return None
        self.topology = topology
        self.expected = topology.gateway_mask()
        if self.fallback is not None:
            self.fallback.expected = self.expected
            self.fallback.epoch = switch.epoch
        elif self.xdp is not None:
            self.xdp.redeploy(expected=self.expected, epoch=switch.epoch)
        for head, address in self._aggregators.items():
            self._moved(head, switch.since, address)
        log.info("edge gateway: deployment epoch %d from iteration %d: clusters %s (was %s)", switch.epoch,
                 switch.since, dict(topology.clusters), dict(switch.previous.clusters))
        return switch

    def services_missing(self, topology: LanTopology) -> list[int]:
        """The aggregators ``topology`` names whose service never said HELLO here (its members could not be
        told where to send: such a deployment waits)."""
        return sorted(h for h in topology.clusters if h not in self._aggregators)

    def _moved(self, worker: int, iteration: int, address: Address) -> None:
        """Tell ``worker`` (a worker, or an aggregator service) at ``address`` to say HELLO again."""
        notice = control_packet(Kind.MOVED, job=self.job, worker=worker, iteration=iteration, epoch=self.epoch,
                                token=self.tokens.gateway(worker, iteration))
        self.moved_sent += 1
        self._control(notice, address)

    def _on_stale(self, exc: StaleDeployment, address: Address) -> None:
        """DATA of another epoch reached the gateway: its sender is told (see netstorm/lan/redeploy.py)."""
        if exc.worker < self.workers and self.deployments.on_stale(exc.worker, exc.iteration, exc.epoch,
                                                                   time.monotonic()):
            self.stale_told += 1
            self._moved(exc.worker, exc.iteration, address)

    def _behind(self, worker: int, iteration: int) -> bool:
        """Whether ``worker``, about to be NACKed for ``iteration``, never asked for the current deployment:
        it is sent MOVED instead (at most once per hold), since its DATA goes where the old one said (to an
        aggregator that refuses it, perhaps without its tokens to answer)."""
        told = self._hello_epoch.get(worker, self.epoch)
        if told == self.epoch:
            return False
        address = self.addresses.get(worker)
        if address is not None and self.deployments.on_stale(worker, iteration, told, time.monotonic()):
            self.stale_told += 1
            self._moved(worker, iteration, address)
        return True

    def layout_of(self, iteration: int) -> EdgeLayout:
        """The layout ``iteration`` travels on: its planned one, else the model's."""
        planned = self._wires.get(iteration)
        return self.layout if planned is None else planned[0]

    def result_wire(self, iteration: int) -> ResultWire:
        """How ``iteration``'s result goes back: as planned, else float32 lanes on its layout."""
        planned = self._wires.get(iteration)
        return ResultWire.float32(self.layout) if planned is None else planned[2]

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
            if self.kernel_results:   # the token of the results the program sends the group
                self._aggregator.install_tokens([(GROUP_TOKENS, k, self.tokens.group(k))
                                                 for k in range(first, last + 1)])
        self._installed = max(self._installed, last)

    def watch(self, iteration: int, watcher: Callable[[np.ndarray], None]) -> IterationSums:
        """Call ``watcher`` with the sequence numbers of ``iteration``'s chunks as they complete (from now on;
        the returned sums' ``open`` mask says which completed before). ValueError outside the window the
        gateway receives."""
        if not self._accepts(iteration):
            raise ValueError(f"iteration {iteration} is outside the window the gateway receives")
        sums = self._sums(iteration)
        sums.watchers.append(watcher)
        return sums

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
                if sums.failure is not None:
                    raise sums.failure
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
            if iteration in self._streams:
                self._finish_stream(iteration)
            return sums.result()
        finally:
            stream = self._streams.pop(iteration, None)
            if stream is not None:
                stream.sums.on_complete = None
            self._waiters.pop(iteration, None)
            self._open.pop(iteration, None)
            self._finished[iteration] = sums
            for old in [k for k in self._finished if k < iteration - 4]:
                del self._finished[old]

    async def send_results(self, iteration: int, results: Sequence[np.ndarray], *, total: int,
                           unicast: bool = False) -> None:
        """Queue for every worker the result of each chunk, a sum over ``total`` workers (the node's
        contributor count), in the iteration's planned ``result_wire`` (float32 lanes unless a compressed
        round planned exact integers or a bitmap), once to the multicast group (``unicast``, or without a
        group: a copy to each worker, as for the first result, which a worker may be asked for before it
        joined the group); kept for PULLs until 4 iterations later. Returns once queued: the send task paces
        the burst (bpf/outbox.py), one batch per destination in turn, so a worker whose copy leaves slowly
        delays only its own. WireError if a result does not fit its planned format."""
        self.expect(iteration + 1)   # the workers' next DATA
        back = self.result_wire(iteration)
        blocks: list[np.ndarray] = []
        for t, r in enumerate(results):
            precision, lanes = back.encode(t, np.asarray(r))
            rows = result_packets(back.layout, job=self.job, iteration=iteration, tensor=t, values=lanes,
                                  total=total, precision=precision)
            # a tensor's datagrams share one width (the next tensor's may differ); its last, often short,
            # chunk goes without the padding lanes
            blocks.extend(_trimmed(set_epoch(rows, self.epoch), precision))
        self._keep_results(iteration, back.layout, blocks)
        absent = [w for w in range(self.workers) if w not in self.addresses]
        self._queue_results(iteration, blocks, unicast=unicast)
        if absent:
            raise EdgeTimeout(f"edge gateway: iteration {iteration}: no address for workers {absent} (never said "
                              "HELLO); the others got their results")

    def stream_results(self, iteration: int, *, total: int, unicast: bool = False) -> None:
        """The result of ``iteration`` is this LAN's own sum (no WAN step changes it): from now on each
        chunk's result (its exact sum over ``total`` workers, rounded to float32 as ``send_results`` would)
        goes to the workers as soon as the chunk completes, in one burst per batch of aggregates handled,
        instead of all of them after the last chunk. A worker's uplink then carries the rest of its gradient
        while its downlink already carries the results, as a ring all-reduce uses both directions at once.
        Chunks completed before the call go at once. ``collect`` still returns the whole sum; once the
        iteration is complete its results are kept for PULLs as ``send_results`` keeps them, and the next
        iteration is expected (``send_results`` is then not called for it). Float32 results only: a round
        planned with a narrower result form (a compressed job's) goes by ``send_results``."""
        if not self._accepts(iteration):
            raise ValueError(f"iteration {iteration} is outside the window the gateway receives")
        if iteration in self._streams:
            return
        if self.result_wire(iteration) != ResultWire.float32(self.layout_of(iteration)):
            raise ValueError(f"iteration {iteration} has a planned result form other than float32 lanes")
        sums = self._sums(iteration)
        layout = sums.layout
        # a row is written when its chunk's result is sent, and read only after (``sent``)
        rows = populated((layout.num_chunks, HEADER_BYTES + 4 * layout.lanes), np.uint8)
        stream = _Stream(sums, total, unicast, rows=rows, sent=np.zeros(layout.num_chunks, bool))
        self._streams[iteration] = stream
        sums.on_complete = stream.due.append
        done = np.flatnonzero(~sums.open)
        if done.size:
            stream.due.append(done)
            self._flush_streams()

    # ------------------------------------------------------------------ internals
    def _flush_streams(self) -> None:
        """Send the results of the chunks completed since the last flush, for every streamed iteration."""
        for iteration, stream in self._streams.items():
            if not stream.due:
                continue
            seqs = distinct(np.concatenate(stream.due))
            stream.due.clear()
            seqs = seqs[~stream.sent[seqs]]
            if not seqs.size:
                continue
            sums = stream.sums
            # built in place in the rows kept for PULLs, one run of consecutive chunks at a time (one or a few
            # per batch: aggregates complete about in model order); those views are what the outbox sends
            blocks = chunk_results_into(stream.rows, sums.layout, job=self.job, iteration=iteration, seqs=seqs,
                                        raw=sums.raw, scales=sums.scales, total=stream.total)
            for block in blocks:
                set_epoch(block, self.epoch)
            stream.sent[seqs] = True
            if not sums.done:
                self.streamed_chunks += int(seqs.size)
            self._queue_results(iteration, blocks, unicast=stream.unicast)

    def _finish_stream(self, iteration: int) -> None:
        """``iteration`` is complete: its last results leave, all are kept for PULLs, the next is expected."""
        self._flush_streams()
        stream = self._streams.pop(iteration)
        stream.sums.on_complete = None
        layout = stream.sums.layout
        blocks: list[np.ndarray] = []
        for first, chunks in zip(layout.first_slot, layout.chunks, strict=True):
            own = stream.rows[first: first + chunks]
            blocks += [own[:-1], own[-1:]]
        self._keep_results(iteration, layout, blocks)
        self.expect(iteration + 1)

    def _keep_results(self, iteration: int, layout: EdgeLayout, blocks: list[np.ndarray]) -> None:
        """Keep ``iteration``'s result datagrams (two blocks per tensor) for PULLs until 4 iterations later."""
        self._results[iteration] = (layout, blocks)
        for old in [k for k in self._results if k < iteration - 4]:
            del self._results[old]
        self.outbox.forget(iteration - 4)

    def _queue_results(self, iteration: int, blocks: list[np.ndarray], *, unicast: bool) -> None:
        """Queue result datagrams (blocks of rows of one width each) once to the group (or, ``unicast`` or
        without a group, a copy to each worker that said HELLO), each with its token."""
        if self.group is not None and not unicast:
            # one copy of each datagram; the LAN replicates it to every member of the group
            for rows in blocks:
                if not len(rows):
                    continue
                mine = with_token(rows, self.tokens.group(iteration)) if self.tokens.enabled else rows
                self.outbox.bulk(mine, self.group, tag=iteration)
        else:
            for w in range(self.workers):
                address = self.addresses.get(w)
                if address is None:
                    continue
                for rows in blocks:
                    if not len(rows):
                        continue
                    mine = with_token(rows, self.tokens.gateway(w, iteration)) if self.tokens.enabled else rows
                    self.outbox.bulk(mine, address, tag=iteration)
        self._wake.set()

    def _result_row(self, iteration: int, tensor: int, chunk: int) -> np.ndarray | None:
        """The RESULT datagram of ``(tensor, chunk)`` of ``iteration`` if it was sent (None: not kept, or its
        chunk has not completed yet); WireError for a chunk the result does not have."""
        kept = self._results.get(iteration)
        if kept is not None:
            # kept one row per chunk of the result's layout (its tensor and chunk), not per pool slot: with
            # a pool smaller than the model the slot names several chunks
            layout, blocks = kept
            index = layout.seq(tensor, chunk) - layout.first_slot[tensor]
            full, last = blocks[2 * tensor: 2 * tensor + 2]
            return full[index: index + 1] if index < len(full) else last
        stream = self._streams.get(iteration)
        if stream is not None:
            seq = stream.sums.layout.seq(tensor, chunk)
            if stream.sent[seq]:
                return stream.rows[seq: seq + 1]
        return None

    def fail(self, iteration: int, reason: str = "") -> None:
        """The node failed ``iteration`` (this LAN's sum was incomplete, or the WAN step failed): no result
        will come. Its sums, if still being collected, end with ``IterationAborted``; the workers are told
        with one FAILED datagram (to the group, or a unicast copy each), so they end the iteration at once
        instead of at their own timeout, and go on with the next one, whose tokens are installed here. A
        worker that missed the datagram learns it from the answer to its next PULL or QUERY."""
        self.failed[iteration] = reason
        for old in sorted(self.failed)[:-KEEP_FAILED]:
            del self.failed[old]
        sums = self._open.get(iteration)
        if sums is not None and not sums.done and sums.failure is None:
            sums.failure = IterationAborted(f"edge gateway: iteration {iteration} failed at the node"
                                            f"{': ' + reason if reason else ''}")
            waiter = self._waiters.get(iteration)
            if waiter is not None:
                waiter.set()
        self.expect(iteration + 1)   # the workers' next DATA
        if self.group is not None:
            self._control(control_packet(Kind.FAILED, job=self.job, worker=0, iteration=iteration,
                                         token=self.tokens.group(iteration)), self.group)
            return
        notice = control_packet(Kind.FAILED, job=self.job, worker=0, iteration=iteration)
        for w, address in self.addresses.items():
            self._control(self._stamp(notice, w), address)

    # ------------------------------------------------------------------ internals
    def _sums(self, iteration: int) -> IterationSums:
        sums = self._open.get(iteration)
        if sums is None:
            planned = self._wires.get(iteration)
            layout, integer = (self.layout, False) if planned is None else planned[:2]
            sums = IterationSums(layout, iteration, self.workers, self.job, integer=integer,
                                 lanes_kept=not self.kernel_results)
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
        """``datagram`` with ``worker``'s gateway token for the iteration it names and the current deployment
        epoch (a NACK's epoch tells a worker still sending under another one to ask for its part)."""
        datagram = datagram[:_EPOCH_AT] + self.epoch.to_bytes(2, "little") + datagram[_EPOCH_AT + 2:]
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
            if self._behind(worker, int.from_bytes(datagram[_ITERATION_AT: _ITERATION_AT + 4], "little")):
                continue
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
        seqs = np.flatnonzero(sums.open)[:256]
        address = self.addresses.get(0)
        if not seqs.size or address is None:
            return
        for nack in nack_packets(seqs, job=self.job, iteration=sums.iteration):
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
                with contextlib.suppress(WireError):
                    self._ack(head.iteration, self._finished[head.iteration].layout.seq(head.tensor, head.chunk))
            return
        sums = self._sums(head.iteration)
        self._emit(sums.on_agg(head, lanes_of(data)))
        if not sums.is_pending(head.tensor, head.chunk) and sums.failure is None:
            self._ack(head.iteration, sums.layout.seq(head.tensor, head.chunk))
        if sums.done or sums.failure is not None:
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
        seqs = np.frombuffer(data, "<u4", count=min(head.count, QUERY_LIMIT), offset=HEADER_BYTES).astype(np.int64)
        if self.kernel_results and self._done(head.iteration):
            # every chunk of it completed in the program, whose shadow slots keep each until every worker has
            # its result: the asker lost these, and its resends have the program send them again
            seqs = seqs[seqs < self.layout.num_chunks]
            if seqs.size:
                self._nacks.setdefault((head.iteration, head.worker), []).append(seqs)
                self.query_nacks_sent += int(seqs.size)
            return
        sums = self._open.get(head.iteration)
        if sums is None and self.kernel_results and self._accepts(head.iteration):
            sums = self._sums(head.iteration)   # no aggregate ever opens it: the slots say everything
        pending = seqs[:0]
        if sums is not None:
            seqs = seqs[seqs < sums.layout.num_chunks]
            done, pending = seqs[~sums.open[seqs]], seqs[sums.open[seqs]]
        elif head.iteration in self._finished:
            done = seqs
        else:
            return
        token = self.tokens.gateway(head.worker, head.iteration)
        for datagram in ack_packets(done, job=self.job, iteration=head.iteration):
            stamped = datagram[:TOKEN_AT] + token.to_bytes(8, "little") + datagram[TOKEN_AT + 8:]
            self._control(stamped, address)
        if self.query_nacks and sums is not None and pending.size:
            self._missing_nacks(sums, head.worker, pending)

    def _nack_gaps(self) -> None:
        """The gateway's own gap rule: workers send chunks in order, so a chunk still open GAP_CHUNKS below
        the highest completed one lost a datagram; its missing workers are NACKed once, at once, without
        waiting for their QUERY (which stays the recovery for what this misses or loses)."""
        for sums in self._open.values():
            top = sums.highest - GAP_CHUNKS
            if top <= sums.gap_checked:
                continue
            seqs = sums.gap_checked + np.flatnonzero(sums.open[sums.gap_checked: top])
            sums.gap_checked = top
            if seqs.size:
                self._missing_nacks(sums, None, seqs[:QUERY_LIMIT])

    def _missing_nacks(self, sums: IterationSums, asker: int | None, seqs: np.ndarray) -> None:
        """Queue NACKs for the incomplete chunks ``seqs`` of ``sums``' iteration, each to the unclustered
        workers its slot (read from the aggregator: the kernel's map, or the fallback's slots) has no
        contribution from. A missing cluster aggregator is NACKed as a unit, once per chunk and hold
        (``_nack_clusters``): it reads its own slot's contributor bitmap and NACKs exactly the members missing
        from it (or has its completed slot re-emitted), which the gateway cannot tell apart. A slot that
        holds no part of the chunk names the asker (its cluster's aggregator for a member); below a completed
        chunk (``asker`` None, the gap rule) a slot holding an older key or nothing names every contributor,
        since every one's datagram was lost (a newer key means the chunk completed and its aggregate is on its
        way: nobody). One pass over every chunk at once: a (chunk, worker) matrix of who is missing, whose
        columns are the workers' lists (``_flush_nacks`` sends each as one datagram)."""
        if not seqs.size:
            return
        layout = sums.layout
        states = self._aggregator.slot_states(layout.slot_numbers(seqs, sums.iteration))
        tensors, chunks = layout.locate_many(seqs)
        bitmap = states["bitmap"].astype(np.uint64)
        here = (states["iteration"].astype(np.int64) == (sums.iteration & 0xFFFFFFFF)) & \
            (states["tensor"].astype(np.int64) == tensors) & (states["chunk"].astype(np.int64) == chunks) & \
            (bitmap != 0)
        expected = np.uint64(self.expected)
        if asker is not None:
            asker_head = self.topology.aggregator_of(asker)
            elsewhere = np.full(seqs.size, np.uint64(1 << (asker if asker_head is None else asker_head)))
        else:
            lost = np.array([not int(b) or _older((int(st["iteration"]), int(st["tensor"]), int(st["chunk"])),
                                                 (sums.iteration, t, c))
                             for st, b, t, c in zip(states, bitmap.tolist(), tensors.tolist(), chunks.tolist(),
                                                    strict=True)], bool)
            elsewhere = np.where(lost, expected, np.uint64(0))
        left = np.where(here, expected & ~bitmap, elsewhere)
        if self.kernel_results and asker is not None:
            # the slot completed but the asker has no result: its resend has the program send it again
            left = np.where(here & (bitmap & expected == expected), np.uint64(1 << asker), left)
        bits = ((left[:, None] >> np.arange(self.workers, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(bool)
        heads = [w for w in self.topology.clusters if w < self.workers]
        clustered = [(w, int(seq)) for w in heads for seq in seqs[bits[:, w]].tolist()]
        if heads:
            bits[:, heads] = False      # their services NACK their own members
        self.query_nacks_sent += int(bits.sum())
        for worker in np.flatnonzero(bits.any(axis=0)).tolist():
            self._nacks.setdefault((sums.iteration, worker), []).append(seqs[bits[:, worker]])
        self._nack_clusters(sums, clustered)

    def _flush_nacks(self) -> None:
        """Send the NACKs gathered while handling a batch of datagrams (or slot reports): one datagram per
        worker and iteration listing every chunk it is to resend (256 a datagram), not one per chunk."""
        nacks, self._nacks = self._nacks, {}
        for (iteration, worker), parts in nacks.items():
            if self._behind(worker, iteration):
                continue
            address = self.addresses.get(worker)
            if address is None:
                log.warning("edge gateway: cannot NACK worker %d: no HELLO yet", worker)
                continue
            seqs = distinct(np.concatenate(parts))
            for datagram in nack_packets(seqs, job=self.job, iteration=iteration):
                self.nack_datagrams += 1
                if not self._control(self._stamp(datagram, worker), address):
                    log.warning("edge gateway: send queue full, NACK to worker %d dropped (it asks again)", worker)

    def _nack_clusters(self, sums: IterationSums, nacks: list[tuple[int, int]]) -> None:
        """NACK each (aggregator, chunk sequence number) to that cluster aggregator's service (not its worker's
        own trainer), at most once per chunk per hold (``cluster_nack_packet``: the chunk's slot fields and its
        number): the aggregator NACKs its own missing members from its slot's bitmap. A cluster whose service
        has not said HELLO is skipped (the slot timers repeat); one that has not said it under the current
        deployment epoch is sent MOVED instead (it missed the switch: its aggregator still sums the old
        cluster)."""
        now = time.monotonic()
        hold = max(self.retransmit, self.slot_timeout, CLUSTER_NACK_HOLD)
        for head, seq in nacks:
            address = self._aggregators.get(head)
            if address is None or now - sums.cluster_nacked[seq] < hold:
                continue
            told = self.deployments.services.get(head, self.epoch)
            if told != self.epoch:
                # keyed apart from the worker's own trainer (ids past MAX_WORKERS)
                if self.deployments.on_stale(MAX_WORKERS + head, sums.iteration, told, now):
                    self.stale_told += 1
                    self._moved(head, sums.iteration, address)
                continue
            sums.cluster_nacked[seq] = now
            nack = cluster_nack_packet(sums.layout, seq, job=self.job, iteration=sums.iteration)
            self.cluster_nacks_sent += 1
            if not self._control(self._stamp(nack, head), address):
                log.warning("edge gateway: send queue full, NACK to the aggregator of cluster %d dropped", head)

    def deployment(self, worker: int, *, aggregator: bool = False) -> Deployment | None:
        """What ``worker`` is told in the answer to its HELLO (None: not yet known, its aggregator's service
        has not said HELLO under the current epoch; the worker asks again). An aggregator service whose
        worker aggregates no cluster in this deployment is told to stand by."""
        head = self.topology.aggregator_of(worker)
        send_to: tuple[str, int] | None = None
        if head is not None and not aggregator:
            found = self._aggregators.get(head)
            if found is None or not self.deployments.member_ready(worker):
                return None
            send_to = (found[0], self.sock.getsockname()[1])
        members = self.topology.clusters.get(worker, ()) if aggregator else ()
        return Deployment(pool=self.layout.num_slots, lanes=self.layout.lanes, scale=self.layout.scales[0],
                          send_to=send_to, group=self.group, members=tuple(members), retransmit=self.retransmit,
                          query_nacks=self.query_nacks, kernel_results=self.kernel_results,
                          first_iteration=self._base, gia_threshold=self.gia_threshold, epoch=self.epoch,
                          standby=aggregator and worker not in self.topology.clusters,
                          pace_gbit=None if aggregator else self.pace_gbit.get(worker))

    def _on_events(self, events: list[SlotEvent]) -> None:
        """The slot timers' reports: unclustered missing workers are NACKed, a missing cluster aggregator's
        service is asked to NACK its own missing members (``_nack_clusters``)."""
        clusters = self.topology.clusters
        for event in events:
            if event.slot == ITERATION_DONE:
                if event.job == self.job and self.kernel_results:
                    self._on_done(event.iteration)
                continue
            if event.job != self.job or not self._accepts(event.iteration):
                continue
            sums = self._sums(event.iteration)
            found = sums.on_event(event)
            if found is None:
                continue
            seq, missing = found
            if clusters:
                self._nack_clusters(sums, [(w, seq) for w in missing if w in clusters])
                missing = [w for w in missing if w not in clusters]
            for worker in missing:   # gathered: one NACK datagram per worker for every report of this wake-up
                self._nacks.setdefault((event.iteration, worker), []).append(np.array([seq], np.int64))
        if self._nacks:
            self._flush_nacks()

    def _on_ring(self) -> None:
        """The program's reports (slot timers, gaps, completed iterations), counted as receive work."""
        assert self.xdp is not None
        started = time.thread_time()
        self._on_events(self.xdp.drain_events())
        if self._acks:
            self._flush_acks()
        self.receive_cpu += time.thread_time() - started

    def _handle(self, data: bytes, address: Address) -> None:
        kind = data[KIND_AT] if len(data) >= HEADER_BYTES else 0
        if kind == Kind.AGG:
            if self.fallback is not None:   # the userspace aggregator hands its aggregates over directly
                raise WireError(f"AGG datagram from {address}: only the XDP data plane makes them")
            self._on_agg(data)
        elif kind == Kind.DATA and self.fallback is not None:
            now = time.monotonic()
            self._measure(data, now)
            try:
                agg = self.fallback.on_data(data, now)
            except StaleDeployment as exc:
                self._on_stale(exc, address)
                return
            if agg is not None:
                self._on_agg(agg)
        else:
            head = Header.decode(data)
            if head.job != self.job:
                raise WireError(f"datagram of job {head.job}, this gateway serves job {self.job}")
            if head.kind in (Kind.HELLO, Kind.PULL, Kind.QUERY, Kind.REPORT) and head.worker >= self.workers:
                raise WireError(f"{head.kind.name} from worker {head.worker}: this gateway serves workers "
                                f"0..{self.workers - 1}")
            # a PULL for a result we do not keep has no answer: dropped before any token is derived for it
            failed = head.kind in (Kind.PULL, Kind.QUERY) and head.iteration in self.failed
            row = None
            if head.kind == Kind.PULL and not failed:
                with contextlib.suppress(WireError):
                    row = self._result_row(head.iteration, head.tensor, head.chunk)
                if row is None:
                    return
            if head.kind == Kind.QUERY and head.iteration not in self._open and head.iteration not in self._finished \
                    and not failed and not (self.kernel_results and (self._accepts(head.iteration)
                                                                     or self._done(head.iteration))):
                return   # (with results from the kernel no aggregate opens an iteration: the slots answer)
            if head.kind == Kind.REPORT and head.iteration not in self._finished:
                return
            # HELLO nonces are the sender's choice: their tokens are derived, never cached
            if head.kind in (Kind.HELLO, Kind.PULL, Kind.QUERY, Kind.REPORT) and not self.tokens.valid(
                    Sender.WORKER, head.worker, head.iteration, head.token, keep=head.kind != Kind.HELLO):
                self.forged += 1
                raise WireError(f"{head.kind.name} as worker {head.worker} from {address} with a wrong token")
            if failed:   # about an iteration the node failed: the worker missed the FAILED notice
                notice = control_packet(Kind.FAILED, job=self.job, worker=head.worker, iteration=head.iteration)
                self._control(self._stamp(notice, head.worker), address)
            elif head.kind == Kind.HELLO:
                self._on_hello(head, data, address)
            elif head.kind == Kind.QUERY:
                self._answer_query(head, data, address)
            elif head.kind == Kind.REPORT:
                self.downlinks.on_report(head.worker, head.iteration, parse_report(data)[1])
            elif head.kind == Kind.PULL:
                if row is not None:
                    if self.tokens.enabled:
                        row = with_token(row, self.tokens.gateway(head.worker, head.iteration))
                    # with that worker's other bulk: a slow worker's PULLs wait behind its own backlog
                    self.outbox.bulk(row, address, tag=head.iteration)
                    self._wake.set()
            elif head.kind == Kind.DATA and head.epoch != self.epoch:
                # the program passes up DATA of another epoch (its token checked there): told, never summed
                self._on_stale(StaleDeployment("", worker=head.worker, iteration=head.iteration, epoch=head.epoch),
                               address)
            elif head.kind == Kind.DATA and head.precision != Precision.FIXED32 and self.xdp is not None:
                # narrow lanes the program could not widen in place: widened here, aggregated there
                verdict, out = self.xdp.run_widened(data)
                if verdict == XDP_PASS and len(out) >= HEADER_BYTES and out[KIND_AT] == Kind.AGG:
                    self._on_agg(out)
                elif verdict == XDP_TX and self.group is not None and len(out) >= HEADER_BYTES \
                        and out[KIND_AT] == Kind.RESULT:
                    self._control(out, self.group)   # the program's own result: sent where it would have gone
            elif head.kind == Kind.DATA:
                raise WireError(f"DATA from worker {head.worker} reached the agent in xdp mode (malformed?)")
            else:
                raise WireError(f"unexpected {head.kind.name} datagram from {address}")

    def _measure(self, data: bytes, now: float) -> None:
        """Count a DATA datagram towards its worker's achieved uplink (bpf/uplinks.py), read straight from the
        header words (the aggregator validates the datagram itself)."""
        def word(at: int) -> int:
            return int.from_bytes(data[at: at + 4], "little")
        self._measure_fields(data[_WORKER_AT], word(_ITERATION_AT), word(_TENSOR_AT), word(_CHUNK_AT), len(data), now)

    def _measure_fields(self, worker: int, iteration: int, tensor: int, chunk: int, nbytes: int, now: float) -> None:
        if not self._accepts(iteration):
            return
        layout = self.layout_of(iteration)
        if tensor >= len(layout.sizes) or chunk >= layout.chunks[tensor]:
            return
        self.uplinks.on_data(worker, iteration, layout.first_slot[tensor] + chunk, nbytes, now)

    def summed_at(self, iteration: int) -> tuple[float, float] | None:
        """When the first and the last chunk of a collected ``iteration`` completed (monotonic clock)."""
        sums = self._finished.get(iteration)
        return None if sums is None else (sums.first_at, sums.done_at)

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        """Each worker's first window of ``iteration`` as (worker, bytes, first, last arrival): timed here in
        userspace mode, by the XDP program in xdp mode (its meter map, read in one batched lookup)."""
        if self.xdp is not None and self.mode == "xdp":
            return self.xdp.uplink_spans(iteration, self.workers)
        return self.uplinks.close(iteration)

    def downlink_bursts(self) -> list[tuple[int, int, float, float]]:
        """The result bursts workers reported since the last call, as (worker, bytes, 0, span)."""
        return self.downlinks.drain()

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
        deployment = self.deployment(head.worker, aggregator=aggregator)
        if deployment is None:
            return
        if aggregator:
            self.deployments.on_service_hello(head.worker)
        bound[head.worker] = address
        if not aggregator:
            self._hello_epoch[head.worker] = self.epoch
            self._hello.set()
        # the answer tells the worker our layout (tensors, chunks) and scale, so it can check its own
        reply = control_packet(Kind.HELLO, job=self.job, worker=head.worker, iteration=head.iteration,
                               tensor=len(self.layout.sizes), chunk=self.workers, slot=self.layout.num_chunks,
                               scale=self.layout.scales[0], flags=head.flags & Flag.AGGREGATOR, epoch=self.epoch,
                               token=self.tokens.of(Sender.GATEWAY, head.worker, head.iteration, keep=False))
        self._control(reply + deployment.encode(), address)

    def _drain(self) -> None:
        """Handle what is queued on the socket: one ``recvmmsg`` of up to a batch (the kernel keeps the
        rest for the next wake-up), every header checked at once (``valid_headers``); valid AGG datagrams
        are taken together (``_take_aggs``), anything else one by one (``_handle``), where an invalid one
        is rejected and logged as before, without affecting the rest of the batch."""
        started = time.thread_time()
        batch = self._rx
        batch.clear()
        udp.receive_batch(self.sock, batch)
        if batch.count:
            heads = batch.headers()
            aggs = valid_headers(heads, batch.lengths) & (heads["kind"] == _AGG)
            if self.fallback is None and aggs.any():
                self._take_aggs(np.flatnonzero(aggs))
            else:
                aggs[:] = False
            kinds = heads["kind"]
            now = time.monotonic()
            for row in np.flatnonzero(~aggs).tolist():
                data = batch.datagram(row)
                try:
                    if self.fallback is not None and kinds[row] == _DATA:
                        # the userspace aggregator's DATA: no answer goes back, so no address is needed;
                        # it counts towards its worker's achieved uplink as in ``_handle``
                        self._measure_fields(int(heads["worker"][row]), int(heads["iteration"][row]),
                                             int(heads["tensor"][row]), int(heads["chunk"][row]), len(data), now)
                        agg = self.fallback.on_data(data, now)
                        if agg is not None:
                            self._on_agg(agg)
                    else:
                        self._handle(data, batch.address(row))
                except StaleDeployment as exc:
                    self._on_stale(exc, batch.address(row))
                except WireError as exc:
                    self.errors += 1
                    log.warning("edge gateway: rejected datagram from %s: %s", batch.address(row), exc)
        if self.query_nacks:
            self._nack_gaps()
        if self._nacks:
            self._flush_nacks()
        if self._acks:
            self._flush_acks()
        if self._streams:
            self._flush_streams()
        self.receive_cpu += time.thread_time() - started

    def _take_aggs(self, rows: np.ndarray) -> None:
        """The valid AGG datagrams of a batch at once: the agent's token checked, other jobs dropped, each
        iteration's aggregates taken into its sums with one copy (``IterationSums.take``) and ACKed; an
        aggregate of an iteration already collected (re-emitted because its ACK was lost) is ACKed again.
        An aggregate flagged OVERFLOW (rare: a RESCALE round follows) goes through ``on_agg``."""
        started = time.thread_time()
        try:
            batch = self._rx
            heads = batch.headers()
            if self.agg_token:
                genuine = heads["token"][rows] == np.uint64(self.agg_token)
                self.forged += int((~genuine).sum())
                rows = rows[genuine]
            rows = rows[heads["job"][rows] == self.job]
            iterations = heads["iteration"][rows]
            # one iteration, nearly always: no sort to find it
            for value in (iterations[:1] if iterations.size and (iterations == iterations[0]).all()
                          else distinct(iterations)):
                iteration = int(value)
                mine = rows[iterations == value]
                if not self._accepts(iteration):
                    if iteration in self._finished:   # re-emitted aggregates: their ACKs were lost, say them again
                        seqs, known = self._finished[iteration].layout.seqs(heads["tensor"][mine], heads["chunk"][mine])
                        self._ack_many(iteration, seqs[known])
                    continue
                sums = self._sums(iteration)
                overflow = (heads["flags"][mine] & _OVERFLOW) != 0
                for row in mine[overflow]:
                    data = batch.datagram(int(row))
                    try:
                        self._take_agg(data)
                    except WireError as exc:
                        self.errors += 1
                        log.warning("edge gateway: rejected aggregate: %s", exc)
                plain = mine[~overflow]
                if plain.size and self.kernel_results:
                    continue    # passed up before the program returned results itself: they went to nobody
                if plain.size:
                    seqs, bad = sums.take(heads[plain], batch.lanes("<i4"), plain)
                    if bad:
                        self.errors += bad
                        log.warning("edge gateway: rejected %d aggregates of iteration %d naming no chunk of the "
                                    "layout (or with a wrong lane count)", bad, iteration)
                    self._ack_many(iteration, seqs)
                if sums.done or sums.failure is not None:
                    waiter = self._waiters.get(iteration)
                    if waiter is not None:
                        waiter.set()
        finally:
            self.delivery_cpu += time.thread_time() - started

    def _ack_many(self, iteration: int, seqs: np.ndarray) -> None:
        if seqs.size:
            self._acks.setdefault(iteration, []).extend(seqs.tolist())

    async def _timers(self) -> None:
        assert self.fallback is not None
        while True:
            deadline = self.fallback.next_deadline()
            delay = self.slot_timeout if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.sleep(min(delay, self.slot_timeout))
            self._on_events(self.fallback.expire(time.monotonic()))


def _older(key: tuple[int, int, int], than: tuple[int, int, int]) -> bool:
    """Whether a slot's (iteration, tensor, chunk) ``key`` is older than ``than`` (iterations compared modulo
    2**32, as the aggregation program does)."""
    age = ((than[0] - key[0] + 2**31) & 0xFFFFFFFF) - 2**31
    return age > 0 or (age == 0 and key[1:] < than[1:])


def _trimmed(rows: np.ndarray, precision: Precision) -> tuple[np.ndarray, np.ndarray]:
    """One tensor's RESULT datagrams as (every chunk but the last, the last without its padding lanes):
    a datagram needs only ``count`` lanes, and a result's last chunk is often short (a bitmap of a few
    dozen bytes in a lane width of a thousand)."""
    count = int(rows[-1, OFFSETS["count"]: OFFSETS["count"] + 2].view("<u2")[0])
    return rows[:-1], np.ascontiguousarray(rows[-1:, : HEADER_BYTES + count * precision.lane_bytes])
