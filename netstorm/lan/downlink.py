"""A LAN worker's downlink, measured passively where its results arrive and reported to its gateway.

The gateway sends an iteration's result as one burst (to the multicast group, or a copy per worker), and
the LAN carries it to each worker through that worker's port; so the span from the first to the last
RESULT datagram a worker takes, over the bytes it took, is what its downlink delivered (a port slower than
the burst queues it, or drops what its queue cannot hold, which the worker PULLs later). ``ResultTimer``
times that burst (sans-I/O: bytes and arrival times in); it stops at the worker's first PULL once results
flowed, since PULL answers come after a pause that is not the port's. After the iteration the worker sends
its gateway one REPORT datagram (``report_packet``: the LAN header, kind REPORT, with the worker's token for
the iteration, and a ``DownlinkReport`` as msgpack payload); the gateway checks the token, decodes the
payload against the schema (``parse_report``) and keeps the latest few per worker (``DownlinkReports``), which
its rate meter (netstorm/lanreport.py) takes as ``down`` bursts.

Only spans and byte counts travel, never clock readings: the worker's and the gateway's clocks need not
agree.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, MAX_REPORT_BYTES, Header, Kind
from netstorm.lan.packets import control_packet

MAX_SPAN_NS = 3600 * 10**9
"""A burst longer than an hour is not a measurement."""


class DownlinkReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one iteration's result burst reached a worker (REPORT payload). The iteration and worker are the
    header's, which the token authenticates."""

    nbytes: Annotated[int, msgspec.Meta(ge=0, le=2**40)]
    """Bytes of the RESULT datagrams taken before the first PULL (UDP payload, as the gateway sent them)."""
    span_ns: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPAN_NS)]
    """From the first to the last of them, on the worker's monotonic clock."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


_DECODER = msgspec.msgpack.Decoder(DownlinkReport)


def report_packet(report: DownlinkReport, *, job: int, worker: int, iteration: int, token: int) -> bytes:
    """The REPORT datagram of ``worker`` for ``iteration``, carrying its token for that iteration."""
    payload = report.encode()
    if len(payload) > MAX_REPORT_BYTES:
        raise WireError(f"downlink report of {len(payload)} bytes exceeds {MAX_REPORT_BYTES}")
    return control_packet(Kind.REPORT, job=job, worker=worker, iteration=iteration, token=token) + payload


def parse_report(data: bytes) -> tuple[Header, DownlinkReport]:
    """The header and report of a REPORT datagram; WireError for anything else or a payload the schema
    refuses (the header's own rules bound the payload's size first)."""
    head = Header.decode(data)
    if head.kind != Kind.REPORT:
        raise WireError(f"{head.kind.name} datagram where a REPORT was expected")
    try:
        return head, _DECODER.decode(data[HEADER_BYTES:])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"bad downlink report from worker {head.worker}: {exc}") from None


@dataclass
class ResultTimer:
    """One iteration's result burst at a worker (sans-I/O: arrivals and the clock in)."""

    iteration: int | None = None
    nbytes: int = 0
    first: float = 0.0
    last: float = 0.0
    frozen: bool = False
    """A PULL went out after results flowed: later arrivals are answers, not the burst."""

    def start(self, iteration: int) -> None:
        """A new iteration's results are awaited: forget the last burst."""
        self.iteration, self.nbytes, self.first, self.last, self.frozen = iteration, 0, 0.0, 0.0, False

    def on_results(self, nbytes: int, now: float) -> None:
        """RESULT datagrams of ``nbytes`` (new chunks of the awaited iteration) were taken at ``now``."""
        if self.frozen or nbytes <= 0:
            return
        if not self.nbytes:
            self.first = now
        self.nbytes += nbytes
        self.last = max(self.last, now)

    def on_pull(self) -> None:
        """The worker PULLs missing chunks: once results have flowed, the burst is over."""
        if self.nbytes:
            self.frozen = True

    def report(self) -> DownlinkReport | None:
        """The burst as a report, or None when it says nothing (no bytes, or all in one receive)."""
        span = round((self.last - self.first) * 1e9)
        if self.iteration is None or not self.nbytes or span <= 0:
            return None
        return DownlinkReport(self.nbytes, min(span, MAX_SPAN_NS))


@dataclass
class DownlinkReports:
    """What a gateway keeps of its workers' reports (sans-I/O): the last ``keep`` bursts per worker, at most
    one per iteration and only for iterations newer than the worker's last report, so a replayed or
    repeated report adds nothing and memory is bounded by the workers."""

    workers: int
    keep: int = 8
    _latest: dict[int, int] = field(default_factory=dict)
    _bursts: dict[int, collections.deque[tuple[int, float]]] = field(default_factory=dict)

    def on_report(self, worker: int, iteration: int, report: DownlinkReport) -> bool:
        """Take ``worker``'s (authenticated) report of ``iteration``; False when it adds nothing."""
        if not 0 <= worker < self.workers:
            return False
        latest = self._latest.get(worker)
        if latest is not None and not 0 < (iteration - latest) & 0xFFFFFFFF < 1 << 31:
            return False
        self._latest[worker] = iteration
        self._bursts.setdefault(worker, collections.deque(maxlen=self.keep)).append(
            (report.nbytes, report.span_ns * 1e-9))
        return True

    def drain(self) -> list[tuple[int, int, float, float]]:
        """Every burst taken since the last call, as (worker, bytes, 0, span in seconds)."""
        out = [(w, nbytes, 0.0, span) for w, bursts in sorted(self._bursts.items()) for nbytes, span in bursts]
        for bursts in self._bursts.values():
            bursts.clear()
        return out
