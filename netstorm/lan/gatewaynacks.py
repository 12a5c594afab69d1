"""The LAN gateway's NACK rules: which workers, or which cluster aggregator services, to ask for which chunks
again, from the slots' contributor bitmaps (sans-I/O: the aggregator's slot states and the shell's clock in,
NACK datagrams into the outbox).

Three causes name a chunk: a worker's QUERY (it asks which of its chunks completed), the gateway's own gap
rule (a chunk still open below a completed one lost a datagram), and a slot report (a timer's, or the
program's gap rule). Each NACKs exactly the workers a slot is missing, gathered over one wake-up into one
datagram per worker and iteration (``flush``); a missing cluster aggregator is NACKed as a unit, once per
chunk and hold (``clusters``): it reads its own slot and NACKs its own missing members."""

from __future__ import annotations

import logging

import numpy as np

from netstorm.lan.batch import distinct
from netstorm.lan.gatewayroster import GatewayRoster
from netstorm.lan.header import OFFSETS
from netstorm.lan.packets import cluster_nack_packet, nack_packets
from netstorm.lan.slots import Aggregator
from netstorm.lan.sums import IterationSums

log = logging.getLogger(__name__)
_ITERATION_AT = OFFSETS["iteration"]
GAP_CHUNKS = 1
"""How far below the highest completed chunk an open one must be before the gateway NACKs its missing workers
unasked. One suffices: a worker's datagrams reach the aggregator in the order it sent them (one flow, one
queue), so a completed chunk means every worker's earlier chunks arrived or were lost; aggregates of chunks
completed together may reach the agent out of order, but the slot read decides (a slot that did complete
has no missing worker, and nobody is NACKed)."""
QUERY_LIMIT = 256
"""Chunks of one QUERY the gateway looks at (a worker asks about at most this many per datagram)."""
CLUSTER_NACK_HOLD = 0.02
"""Least time between two NACKs of one chunk to one cluster aggregator (the hold is also at least the workers'
``retransmit``): the gap rule, the slot timers and every member's QUERY may name the same chunk, and the
aggregator answers each by NACKing its missing members, who resend at most once per round trip anyway; on a
shaped LAN a NACK per chunk and QUERY filled the gateway's control queue. Each repeat doubles the hold, up to
CLUSTER_NACK_BACKOFF times, as TCP backs off: a lost answer is asked for again a hold later, a slow cluster
(its service busy) is not flooded. Not the slot timers' period: a cluster whose member's resend was lost then
waited that long, where one level NACKs again on the next QUERY."""
CLUSTER_NACK_BACKOFF = 64
"""The most the hold of one chunk's repeated cluster NACKs grows (64 x 20 ms: about a second)."""
NACKED_DTYPE = np.dtype([("at", np.float64), ("tries", np.uint8)])
"""Per chunk, when it was last NACKed to one cluster aggregator and how many times
(``IterationSums.cluster_nacked``)."""


def older(key: tuple[int, int, int], than: tuple[int, int, int]) -> bool:
    """Whether a slot's (iteration, tensor, chunk) ``key`` is older than ``than`` (iterations compared modulo
    2**32, as the aggregation program does)."""
    age = ((than[0] - key[0] + 2**31) & 0xFFFFFFFF) - 2**31
    return age > 0 or (age == 0 and key[1:] < than[1:])


class NackRules:
    """NACKs gathered per wake-up and sent per worker, and the counters of what went out."""

    def __init__(self, roster: GatewayRoster, aggregator: Aggregator) -> None:
        self.roster = roster
        self.aggregator = aggregator
        self.kernel_results = False
        """The program returns results: a completed slot whose asker lacks the result is its resend's to fix."""
        self.pending: dict[tuple[int, int], list[np.ndarray]] = {}
        """Chunks to NACK per (iteration, worker), gathered over one wake-up (``flush``)."""
        self.query_nacks_sent = 0
        """(worker, chunk) pairs NACKed to unclustered workers missing from a slot, in answer to a QUERY or
        from the gateway's own gap rule."""
        self.nack_datagrams = 0
        """NACK datagrams those went out in (one per worker and wake-up, up to 256 chunks each)."""
        self.cluster_nacks_sent = 0
        """NACKs to a cluster aggregator's service for a chunk its aggregate is missing from (any cause)."""

    def add(self, iteration: int, worker: int, seqs: np.ndarray) -> None:
        """NACK ``worker`` for chunks ``seqs`` of ``iteration`` at the next ``flush``."""
        self.pending.setdefault((iteration, worker), []).append(seqs)

    def gaps(self, open_sums: list[IterationSums], now: float) -> None:
        """The gateway's own gap rule: workers send chunks in order, so a chunk still open GAP_CHUNKS below
        the highest completed one lost a datagram; its missing workers are NACKed once, at once, without
        waiting for their QUERY (which stays the recovery for what this misses or loses)."""
        for sums in open_sums:
            top = sums.highest - GAP_CHUNKS
            if top <= sums.gap_checked:
                continue
            seqs = sums.gap_checked + np.flatnonzero(sums.open[sums.gap_checked: top])
            sums.gap_checked = top
            if seqs.size:
                self.missing(sums, None, seqs[:QUERY_LIMIT], now)

    def missing(self, sums: IterationSums, asker: int | None, seqs: np.ndarray, now: float) -> None:
        """Gather NACKs for the incomplete chunks ``seqs`` of ``sums``' iteration, each to the unclustered
        workers its slot (read from the aggregator) has no contribution from; a missing cluster aggregator
        is NACKed as a unit (``clusters``). A slot that holds no part of the chunk names the asker (its
        cluster's aggregator for a member); below a completed chunk (``asker`` None, the gap rule) a slot
        holding an older key or nothing names every contributor, since every one's datagram was lost (a newer
        key means the chunk completed and its aggregate is on its way: nobody). One pass over every chunk at
        once: a (chunk, worker) matrix of who is missing, whose columns are the workers' lists."""
        if not seqs.size:
            return
        roster = self.roster
        layout = sums.layout
        states = self.aggregator.slot_states(layout.slot_numbers(seqs, sums.iteration))
        tensors, chunks = layout.locate_many(seqs)
        bitmap = states["bitmap"].astype(np.uint64)
        here = (states["iteration"].astype(np.int64) == (sums.iteration & 0xFFFFFFFF)) & \
            (states["tensor"].astype(np.int64) == tensors) & (states["chunk"].astype(np.int64) == chunks) & \
            (bitmap != 0)
        expected = np.uint64(roster.expected)
        if asker is not None:
            asker_head = roster.topology.aggregator_of(asker)
            elsewhere = np.full(seqs.size, np.uint64(1 << (asker if asker_head is None else asker_head)))
        else:
            lost = np.array([not int(b) or older((int(st["iteration"]), int(st["tensor"]), int(st["chunk"])),
                                                (sums.iteration, t, c))
                             for st, b, t, c in zip(states, bitmap.tolist(), tensors.tolist(), chunks.tolist(),
                                                    strict=True)], bool)
            elsewhere = np.where(lost, expected, np.uint64(0))
        left = np.where(here, expected & ~bitmap, elsewhere)
        if self.kernel_results and asker is not None:
            # the slot completed but the asker has no result: its resend has the program send it again
            left = np.where(here & (bitmap & expected == expected), np.uint64(1 << asker), left)
        bits = ((left[:, None] >> np.arange(roster.workers, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(bool)
        heads = [w for w in roster.topology.clusters if w < roster.workers]
        clustered = [(w, int(seq)) for w in heads for seq in seqs[bits[:, w]].tolist()]
        if heads:
            bits[:, heads] = False      # their services NACK their own members
        self.query_nacks_sent += int(bits.sum())
        for worker in np.flatnonzero(bits.any(axis=0)).tolist():
            self.add(sums.iteration, worker, seqs[bits[:, worker]])
        self.clusters(sums, clustered, now)

    def flush(self, now: float) -> None:
        """Send the NACKs gathered while handling a batch of datagrams (or slot reports): one datagram per
        worker and iteration listing every chunk it is to resend (256 a datagram), not one per chunk."""
        roster = self.roster
        nacks, self.pending = self.pending, {}
        for (iteration, worker), parts in nacks.items():
            if roster.behind(worker, iteration, now):
                continue
            address = roster.addresses.get(worker)
            if address is None:
                log.warning("edge gateway: cannot NACK worker %d: no HELLO yet", worker)
                continue
            seqs = distinct(np.concatenate(parts))
            for datagram in nack_packets(seqs, job=roster.job, iteration=iteration):
                self.nack_datagrams += 1
                if not roster.control(roster.stamp(datagram, worker), address):
                    log.warning("edge gateway: send queue full, NACK to worker %d dropped (it asks again)", worker)

    def clusters(self, sums: IterationSums, nacks: list[tuple[int, int]], now: float) -> None:
        """NACK each (aggregator, chunk sequence number) to that cluster aggregator's service (not its worker's
        own trainer), at most once per chunk per hold (``cluster_nack_packet``: the chunk's slot fields and its
        number), the hold doubling with each repeat: the aggregator NACKs its own missing members from its slot's
        bitmap. A cluster whose service
        has not said HELLO is skipped (the slot timers repeat); one that has not said it under the current
        deployment epoch is sent MOVED instead."""
        roster = self.roster
        hold = max(roster.retransmit, CLUSTER_NACK_HOLD)
        for head, seq in nacks:
            address = roster.aggregators.get(head)
            nacked = sums.cluster_nacked.get(head)
            if nacked is None:
                nacked = sums.cluster_nacked[head] = np.zeros(sums.layout.num_chunks, NACKED_DTYPE)
            tries = int(nacked["tries"][seq])
            if address is None or (tries and now - nacked["at"][seq] < hold * min(2 ** (tries - 1),
                                                                                 CLUSTER_NACK_BACKOFF)):
                continue
            if roster.service_behind(head, sums.iteration, now):
                continue
            nacked[seq] = (now, min(tries + 1, 255))
            nack = cluster_nack_packet(sums.layout, seq, job=roster.job, iteration=sums.iteration)
            self.cluster_nacks_sent += 1
            if not roster.control(roster.stamp(nack, head), address):
                log.warning("edge gateway: send queue full, NACK to the aggregator of cluster %d dropped", head)

    def rescale(self, nacks: list[tuple[int, bytes]], now: float) -> None:
        """The RESCALE NACKs an overflowed aggregate made (``IterationSums.on_agg``), one to each worker."""
        roster = self.roster
        for worker, datagram in nacks:
            if roster.behind(worker, int.from_bytes(datagram[_ITERATION_AT: _ITERATION_AT + 4], "little"), now):
                continue
            address = roster.addresses.get(worker)
            if address is None:
                log.warning("edge gateway: cannot NACK worker %d: no HELLO yet", worker)
                continue
            if not roster.control(roster.stamp(datagram, worker), address):
                log.warning("edge gateway: send queue full, NACK to worker %d dropped (the timer repeats it)", worker)

    def poke(self, sums: IterationSums) -> None:
        """A slot can complete while its AGG datagram is lost before the gateway's socket: a duplicate from one
        contributor makes the aggregator re-emit it. Pending slots that are merely incomplete are unaffected
        (the duplicate is dropped) and stay with the timer."""
        roster = self.roster
        seqs = np.flatnonzero(sums.open)[:256]
        address = roster.addresses.get(0)
        if not seqs.size or address is None:
            return
        for nack in nack_packets(seqs, job=roster.job, iteration=sums.iteration):
            roster.control(roster.stamp(nack, 0), address)
