"""Probe accuracy on real kernel links: two namespaces, a veth pair, HTB at a known rate.

The sender (its own thread and event loop inside namespace 0) has a clock skewed by 0.4 s, corrects
it by SNTP against a server in the receiver's namespace, and streams chunks over TCP with ``t_send``
in a small header, several chunks ahead of the wire. The receiver (namespace 1) stamps each chunk's
last byte and feeds a ProbeEstimator. Reports are application goodput; HTB counts Ethernet/IP/TCP
headers too, so the ideal report is about 95 % of the shaped rate (1448 of every 1514 bytes).
Run with ``-s`` to see the measured numbers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import socket
import struct

import numpy as np
import pytest

from netstorm.clock import Clock, serve_sntp
from netstorm.emulation.shaped_links import LinkSpec, Testbed
from netstorm.probe import LinkReport, ProbeEstimator

pytestmark = [pytest.mark.root, pytest.mark.slow]

HEADER = struct.Struct("<Qd")  # payload bytes, t_send
GOODPUT = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 with timestamps: the physical limit
SENDER_SKEW = 0.4
PROBE_NUM = 4
STEP = 10.0  # seconds any single step may take before the test fails


@dataclasses.dataclass(frozen=True)
class Case:
    rate: float
    chunk_bytes: int
    chunks: int
    new_rate: float | None = None
    change_after: int = 0  # chunks received before the rate changes
    pace: float = 0.0  # seconds between sends; 0 = stream (several chunks in flight)


@dataclasses.dataclass
class Received:
    samples: list[tuple[int, float, float]]  # (bytes, t_send, t_last_byte)
    reports: list[LinkReport]
    t_change: float | None


class ChunkReceiver(asyncio.BufferedProtocol):
    """Reads header+payload frames into one preallocated buffer; stamps the last byte of each."""

    def __init__(self, clock: Clock, estimator: ProbeEstimator, max_chunk: int, on_chunk, done) -> None:
        self.clock, self.estimator, self.on_chunk, self.done = clock, estimator, on_chunk, done
        self.buf = memoryview(bytearray(HEADER.size + max_chunk))
        self.want = HEADER.size
        self.have = 0
        self.payload = 0
        self.t_send = 0.0

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.have:self.want]

    def buffer_updated(self, nbytes: int) -> None:
        self.have += nbytes
        if self.have < self.want:
            return
        if self.payload == 0:
            self.payload, self.t_send = HEADER.unpack_from(self.buf)
            self.want = HEADER.size + self.payload
            return
        t_last = self.clock.now()
        self.on_chunk(self.payload, self.t_send, t_last, self.estimator.on_chunk(self.payload, self.t_send, t_last))
        self.have, self.want, self.payload = 0, HEADER.size, 0

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def run_case(case: Case) -> tuple[Received, float]:
    """Run one transfer; returns what the receiver saw and the sender's post-sync clock error."""
    with Testbed(2, [LinkSpec(0, 1, case.rate, case.rate)]) as tb:
        server_addr = tb.address(0, 1)
        ports: concurrent.futures.Future[tuple[int, int]] = concurrent.futures.Future()
        sender_error: list[float] = []

        async def receiver() -> Received:
            clock = Clock()
            est = ProbeEstimator(0, 1, probe_chunk_bytes=case.chunk_bytes // 2, probe_chunk_num=PROBE_NUM)
            out = Received([], [], None)
            loop = asyncio.get_running_loop()
            done = loop.create_future()

            def on_chunk(nbytes, t_send, t_last, report):
                out.samples.append((nbytes, t_send, t_last))
                if report is not None:
                    out.reports.append(report)
                if case.new_rate is not None and len(out.samples) == case.change_after:
                    tb.set_rate(0, 0, case.new_rate)
                    out.t_change = clock.now()

            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((server_addr, 0))
            sntp = await serve_sntp(server_addr, 0, clock.now, sock=udp)
            server = await loop.create_server(
                lambda: ChunkReceiver(clock, est, case.chunk_bytes, on_chunk, done), server_addr, 0)
            ports.set_result((server.sockets[0].getsockname()[1], udp.getsockname()[1]))
            try:
                async with asyncio.timeout(STEP + case.chunks * case.chunk_bytes * 8 / 1e6 / min(
                        case.rate, case.new_rate or case.rate) * 1.5 + case.chunks * case.pace):
                    await done
            finally:
                server.close()
                sntp.close()
            return out

        async def sender() -> None:
            data_port, sntp_port = await asyncio.wrap_future(ports)
            clock = Clock(SENDER_SKEW)
            await clock.sync(server_addr, sntp_port, timeout=STEP)
            sender_error.append(clock.now() - Clock().now())
            async with asyncio.timeout(STEP):
                _, writer = await asyncio.open_connection(server_addr, data_port)
            writer.transport.set_write_buffer_limits(high=3 * case.chunk_bytes)
            payload = bytes(case.chunk_bytes)
            for _ in range(case.chunks):
                writer.write(HEADER.pack(case.chunk_bytes, clock.now()))
                writer.write(payload)
                async with asyncio.timeout(STEP):
                    await writer.drain()
                if case.pace:
                    await asyncio.sleep(case.pace)
            async with asyncio.timeout(STEP * 3):
                writer.close()  # flushes what is still buffered, then closes
                await writer.wait_closed()

        recv_future = tb.run_in(1, receiver)
        send_future = tb.run_in(0, sender)
        limit = 3 * STEP + case.chunks * (case.chunk_bytes * 8 / 1e6 / min(case.rate, case.new_rate or case.rate)
                                          + case.pace)
        send_future.result(timeout=limit)
        received = recv_future.result(timeout=limit)
        return received, sender_error[0]


def assert_tracks(values: list[float], rate: float, delivered: float | None = None) -> None:
    """Reports track the shaped rate: their median within 10 % of the payload it can carry, and none
    more than 10 % above the shaped rate itself.

    The shaper counts Ethernet frames, a report counts TCP payload, so the reference is GOODPUT of the
    shaped rate (the physical limit of what a report can see). A median, because a report is the
    goodput the link achieved: on this shared 2-core host a stall (the process not scheduled, TCP
    recovering a loss in the shaper's queue) slows the window it falls in, which is the host's doing,
    not the probe's; one such window in a run must not decide the verdict. At 155 Mbit/s the link itself
    delivers 0.81-0.95 of the shaped rate from run to run here. ``delivered`` is what the link carried
    over the same chunks, from the receiver's arrival stamps alone (no send stamps, no clocks): when the
    host demonstrably did not carry the payload limit (below 90 % of it, and never below 75 %), the
    reports must be within 10 % of what it did carry.
    """
    assert values
    median = float(np.median(values))
    limit = rate * GOODPUT
    if delivered is not None and delivered < 0.9 * limit:
        print(f"  the link carried {delivered:.1f} Mbit/s, {delivered / limit:.2f} of its payload limit: "
              f"reports judged against that")
        assert delivered >= 0.75 * limit, (delivered, values)
        assert median == pytest.approx(delivered, rel=0.10), (delivered, values)
    else:
        assert median == pytest.approx(limit, rel=0.10), values
    assert max(values) <= rate * 1.10, values


def delivered_mbit(samples: list[tuple[int, float, float]]) -> float:
    """Mbit/s the link carried over ``samples``: the bytes after the first chunk's last byte over the
    time until the last chunk's last byte, from the receiver's stamps alone."""
    assert len(samples) >= 2
    return sum(n for n, _, _ in samples[1:]) * 8 / 1e6 / (samples[-1][2] - samples[0][2])


def in_flight(samples: list[tuple[int, float, float]]) -> np.ndarray:
    """For each chunk, how many earlier chunks had not fully arrived when it was handed to the socket."""
    t_send = np.array([s[1] for s in samples])
    t_last = np.array([s[2] for s in samples])
    return np.array([int(np.sum(t_last[:i] > t_send[i])) for i in range(len(samples))])


def show(name: str, case: Case, received: Received, clock_error: float) -> None:
    flight = in_flight(received.samples)
    ratios = [f"{r.mbit_s:.1f} ({r.mbit_s / shaped_at(case, received, r):.3f} / "
              f"{r.mbit_s / shaped_at(case, received, r) / GOODPUT:.3f})" for r in received.reports]
    print(f"\n[{name}] shaped {case.rate}{f' -> {case.new_rate}' if case.new_rate else ''} Mbit/s, "
          f"chunks {case.chunk_bytes / 1e6:.1f} MB, sender clock error after SNTP {clock_error * 1e3:+.2f} ms, "
          f"chunks in flight at send: max {flight.max()}, mean {flight.mean():.1f}")
    print(f"  reports Mbit/s (ratio to shaped rate / to its TCP goodput limit): {', '.join(ratios)}")


def shaped_at(case: Case, received: Received, report: LinkReport) -> float:
    if received.t_change is not None and report.t > received.t_change and case.new_rate is not None:
        return case.new_rate
    return case.rate


@pytest.mark.parametrize(("rate", "chunk_mb"), [(20.0, 0.75), (60.0, 2.0), (155.0, 4.0)])
def test_streaming_reports_within_ten_percent(rate, chunk_mb):
    case = Case(rate, int(chunk_mb * 1e6), chunks=16)
    received, clock_error = run_case(case)
    show("stream", case, received, clock_error)
    assert abs(clock_error) < 0.005
    assert len(received.reports) == 4
    assert in_flight(received.samples)[2:].min() >= 1  # the sender really was ahead of the wire
    # The first window also holds the new connection's ramp-up (TCP growing its windows while the
    # shaper's queue fills), a real effect measured as it is; the steady state follows.
    window = received.samples[PROBE_NUM - 1:]  # the windows judged: from the first report's last chunk on
    assert_tracks([r.mbit_s for r in received.reports[1:]], rate, delivered_mbit(window))


def test_one_chunk_at_a_time_needs_and_gets_the_clock_correction():
    # Every chunk is sent after the previous one arrived: each sample is t_last - t_send, across two
    # clocks. Uncorrected, the 0.4 s skew would dwarf a 0.28 s chunk; corrected, it is within 10 %.
    case = Case(60.0, 2_000_000, chunks=12, pace=0.45)
    received, clock_error = run_case(case)
    show("paced", case, received, clock_error)
    assert in_flight(received.samples).max() == 0
    assert len(received.reports) == 3
    assert_tracks([r.mbit_s for r in received.reports], 60.0)
    raw = [(n * 8 / 1e6) / (t_last - (t_send - clock_error - SENDER_SKEW)) for n, t_send, t_last in received.samples]
    assert max(raw) < 60.0 * 0.5  # what the skewed clock alone would have reported


@pytest.mark.parametrize(("rate", "new_rate"), [(155.0, 40.0), (40.0, 100.0)])
def test_reports_follow_a_rate_change(rate, new_rate):
    case = Case(rate, 2_000_000, chunks=24, new_rate=new_rate, change_after=8)
    received, clock_error = run_case(case)
    show("change", case, received, clock_error)
    assert received.t_change is not None
    t_last = [s[2] for s in received.samples]
    before, after = [], []
    settled = None
    for k, r in enumerate(received.reports):
        window_start = t_last[k * PROBE_NUM - 1] if k else -np.inf
        if window_start >= received.t_change:
            after.append(r.mbit_s)  # windows that begin after the change measure only the new rate
        elif r.t < received.t_change:
            before.append(r.mbit_s)
        if settled is None and abs(r.mbit_s / new_rate - 1) <= 0.10 and r.t > received.t_change:
            settled = r.t - received.t_change
    assert len(after) >= 3
    changed = next(i for i, sample in enumerate(received.samples) if sample[2] >= received.t_change)
    assert_tracks(before, rate, delivered_mbit(received.samples[:changed]))
    assert_tracks(after, new_rate, delivered_mbit(received.samples[changed + PROBE_NUM:]))
    assert settled is not None
    print(f"  first report within 10 % of {new_rate} Mbit/s: {settled:.2f} s after the change")
