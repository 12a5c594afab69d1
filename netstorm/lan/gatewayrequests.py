"""The gateway's answers to its workers' requests (HELLO, PULL, QUERY, REPORT): the kinds whose entry in
netstorm/lan/kinds.py is ``checked``.

``GatewayCore.datagram`` decodes such a datagram, checks its job and worker id and hands it to the method the
registry names here; each one filters what has no answer first, then checks the worker's token (``admit``),
so a request that would be dropped anyway costs no token derivation."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

from netstorm.lan.downlink import parse_report
from netstorm.lan.errors import WireError
from netstorm.lan.gatewaynacks import QUERY_LIMIT
from netstorm.lan.header import HEADER_BYTES, Header, Kind
from netstorm.lan.packets import control_packet, with_token
from netstorm.lan.tokens import Sender

if TYPE_CHECKING:
    from netstorm.lan.gatewaycore import GatewayCore

Address = tuple[str, int]


class WorkerRequests:
    """The request handlers of one ``GatewayCore`` (they read and write its books)."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def admit(self, head: Header, address: Address, *, keep: bool = True) -> None:
        """A worker's request passes only with that worker's token for its iteration."""
        if not self.core.tokens.valid(Sender.WORKER, head.worker, head.iteration, head.token, keep=keep):
            self.core.roster.forged += 1
            raise WireError(f"{head.kind.name} as worker {head.worker} from {address} with a wrong token")

    def tell_failed(self, head: Header, address: Address) -> None:
        """A request about an iteration the node failed: the worker missed the FAILED notice."""
        self.admit(head, address)
        notice = control_packet(Kind.FAILED, job=self.core.job, worker=head.worker, iteration=head.iteration)
        self.core.roster.control(self.core.roster.stamp(notice, head.worker), address)

    def on_hello(self, head: Header, data: bytes, address: Address, now: float) -> None:
        # HELLO nonces are the sender's choice: their tokens are derived, never cached
        self.admit(head, address, keep=False)
        if self.core.roster.on_hello(head, address, first_iteration=self.core.window.base):
            self.core.hello_seen = True

    def on_pull(self, head: Header, data: bytes, address: Address, now: float) -> None:
        if head.iteration in self.core.failed:
            self.tell_failed(head, address)
            return
        # a PULL for a result we do not keep has no answer: dropped before any token is derived for it
        row = None
        with contextlib.suppress(WireError):
            row = self.core.results.row(head.iteration, head.tensor, head.chunk)
        if row is None:
            return
        self.admit(head, address)
        if self.core.tokens.enabled:
            row = with_token(row, self.core.tokens.gateway(head.worker, head.iteration))
        # with that worker's other bulk: a slow worker's PULLs wait behind its own backlog
        self.core.outbox.bulk(row, address, tag=head.iteration)

    def on_query(self, head: Header, data: bytes, address: Address, now: float) -> None:
        if head.iteration in self.core.failed:
            self.tell_failed(head, address)
            return
        book = self.core.book
        if head.iteration not in book.open and head.iteration not in book.finished \
                and not (self.core.kernel_results and (book.accepts(head.iteration) or self.core.done(head.iteration))):
            return   # (with results from the kernel no aggregate opens an iteration: the slots answer)
        self.admit(head, address)
        self._answer_query(head, data, address, now)

    def on_report(self, head: Header, data: bytes, address: Address, now: float) -> None:
        if head.iteration not in self.core.book.finished:
            return
        self.admit(head, address)
        self.core.downlinks.on_report(head.worker, head.iteration, parse_report(data)[1])

    def _answer_query(self, head: Header, data: bytes, address: Address, now: float) -> None:
        """A worker asks which of its unacknowledged chunks completed (its ACKs may have been lost)."""
        seqs = np.frombuffer(data, "<u4", count=min(head.count, QUERY_LIMIT), offset=HEADER_BYTES).astype(np.int64)
        if self.core.kernel_results and self.core.done(head.iteration):
            # every chunk of it completed in the program, whose shadow slots keep each until every worker has
            # its result: the asker lost these, and its resends have the program send them again
            seqs = seqs[seqs < self.core.layout.num_chunks]
            if seqs.size:
                self.core.nacks.add(head.iteration, head.worker, seqs)
                self.core.nacks.query_nacks_sent += int(seqs.size)
            return
        sums = self.core.book.open.get(head.iteration)
        if sums is None and self.core.kernel_results and self.core.book.accepts(head.iteration):
            sums = self.core.book.sums(head.iteration)   # no aggregate ever opens it: the slots say everything
        pending = seqs[:0]
        if sums is not None:
            seqs = seqs[seqs < sums.layout.num_chunks]
            done, pending = seqs[~sums.open[seqs]], seqs[sums.open[seqs]]
        elif head.iteration in self.core.book.finished:
            done = seqs
        else:
            return
        self.core.acks.answer(head.iteration, done, head.worker, address)
        if self.core.query_nacks and sums is not None and pending.size:
            self.core.nacks.missing(sums, head.worker, pending, now)
