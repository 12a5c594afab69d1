"""The TCP path's wire and core without sockets: frames round-trip through the reader whatever the
split, every length is checked before it sizes anything, the core's sums equal the numpy reference of
the UDP paths bit for bit (fp32, wide lanes, fp16, bf16, int8), and forged, malformed or out-of-order
frames are refused with the reason; ``edge_mode=auto``'s rule as a pure function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from netstorm.lan import tcpwire
from netstorm.lan.errors import WireError
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.pathpick import FALLBACK, Measured, candidates, pick
from netstorm.lan.tcpcore import (
    WINDOW,
    Completed,
    Refuse,
    ResultAssembly,
    Send,
    Summed,
    TcpGatewayCore,
    encode_data,
)
from netstorm.lan.tcpwire import Data, Frame, FrameReader, Hello, Refused, Result, Welcome
from netstorm.lan.tokens import LanTokens, Sender

JOB = 3
SECRET = b"k" * 32
LANES = 357
SIZES = (200_000, 1234, 7)


def feed(reader: FrameReader, data: bytes, step: int, on_frame: Any = None) -> list[tuple[Any, bytes]]:
    """``data`` into ``reader`` ``step`` bytes at a time, as a connection would; each frame to ``on_frame``
    as it completes, and all of them returned."""
    out = []
    at = 0
    while at < len(data):
        buf = reader.buffer()
        n = min(step, len(buf), len(data) - at)
        buf[:n] = data[at: at + n]
        at += n
        for m, p in reader.advance(n):
            out.append((m, bytes(p)))
            if on_frame is not None:
                on_frame(m)
    return out


@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_frames_round_trip_through_the_reader_however_the_bytes_are_split(step: int) -> None:
    hello = Hello(JOB, 5, 99, 1234, (10, 20), int(Precision.FP16))
    data = Data(5, 7, 1, 0, 20, int(Precision.FIXED32), False, 2**64 - 1)
    payload = np.arange(20, dtype="<i4").tobytes()
    stream = tcpwire.encode(hello) + tcpwire.encode(data, len(payload)) + payload
    seen: list[tuple[object, int]] = []

    def expect(message: object, n: int) -> memoryview | None:
        seen.append((message, n))
        return None

    frames = feed(FrameReader(expect, max_payload=1 << 10), stream, step)
    assert [m for m, _ in frames] == [hello, data]
    assert frames[1][1] == payload
    assert seen == [(hello, 0), (data, 80)]


def test_the_reader_refuses_lengths_before_it_allocates() -> None:
    reader = FrameReader(lambda m, n: None, max_payload=1000)
    prefix = tcpwire.PREFIX.pack(tcpwire.MAGIC, tcpwire.VERSION, 10, 2**31)
    with pytest.raises(WireError, match="exceeds 1000"):
        feed(reader, prefix, 1 << 20)
    assert len(reader._scratch) == 0
    with pytest.raises(WireError, match="magic"):
        feed(FrameReader(lambda m, n: None), b"GET / HTTP/1.1\r\n", 1 << 20)
    with pytest.raises(WireError, match="header of 4000 bytes"):
        feed(FrameReader(lambda m, n: None), tcpwire.PREFIX.pack(tcpwire.MAGIC, tcpwire.VERSION, 4000, 0), 64)
    body = b"\x93\xa4data\x01\x02"   # a known tag with missing fields
    with pytest.raises(WireError, match="TCP edge frame header"):
        feed(FrameReader(lambda m, n: None), tcpwire.PREFIX.pack(tcpwire.MAGIC, tcpwire.VERSION, len(body), 0) + body,
             64)


class Lan:
    """A core and its workers' frames, driven by plain calls (conn i is worker i)."""

    def __init__(self, workers: int, secret: bytes | None = SECRET, scale: int = 16) -> None:
        self.layout = EdgeLayout.uniform(SIZES, scale=scale, lanes=LANES)
        self.core = TcpGatewayCore(self.layout, workers=workers, job=JOB, secret=secret)
        self.tokens = LanTokens(secret, JOB)
        for w in range(workers):
            self.hello(w, nonce=1000 + w)

    def hello(self, worker: int, *, nonce: int, conn: int | None = None, token: int | None = None) -> list[object]:
        conn = worker if conn is None else conn
        hello = Hello(JOB, worker, nonce, self.tokens.of(Sender.WORKER, worker, nonce, keep=False)
                      if token is None else token, SIZES, 0)
        self.core.expect(conn, hello, 0)
        return list(self.core.on_frame(conn, hello, memoryview(b""), 0.0))

    def frames(self, worker: int, iteration: int, values: list[np.ndarray], precision: Precision,
               token: int | None = None) -> list[tuple[Data, bytes]]:
        out = []
        for t, flat in enumerate(values):
            for offset, count in tcpwire.frame_bounds(flat.size, self.core.segment):
                payload, wide = encode_data(flat[offset: offset + count], precision, self.layout.scales[t], LANES)
                out.append((Data(worker, iteration, t, offset, count, int(precision), wide,
                                 self.tokens.worker(worker, iteration) if token is None else token), bytes(payload)))
        return out

    def send(self, conn: int, frame: tuple[Data, bytes]) -> list[Send | Completed | Summed]:
        head, payload = frame
        self.core.expect(conn, head, len(payload))
        return self.core.on_frame(conn, head, memoryview(payload), 1.0)


def reference(parts: list[list[np.ndarray]], precisions: list[Precision], scale: int) -> list[np.ndarray]:
    """The UDP paths' exact sum: each worker's values as its precision represents them, chunk by chunk of
    LANES, quantised at the scale, summed in int64."""
    from netstorm.lan.precision import worker_values

    out = []
    for t in range(len(SIZES)):
        total = sum(np.rint(worker_values(p[t], prec, LANES) * 2.0**scale).astype(np.int64)
                    for p, prec in zip(parts, precisions, strict=True))
        out.append((np.asarray(total).astype(np.float64) * 2.0**-scale).astype(np.float32))
    return out


@pytest.mark.parametrize("workers", [2, 5, 8])
def test_sums_equal_the_numpy_reference_over_many_iterations_and_precisions(workers: int) -> None:
    lan = Lan(workers)
    rng = np.random.default_rng(workers)
    cycle = [Precision.FIXED32, Precision.FP16, Precision.BF16, Precision.INT8]
    for iteration in range(6):
        precisions = [cycle[(w + iteration) % 4] for w in range(workers)]
        parts = [[(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for s in SIZES]
                 for _ in range(workers)]
        if iteration == 5:   # one worker's fp32 values beyond int32 at the scale: that frame travels wide
            parts[0][0][:10] = 2.0**20
            precisions[0] = Precision.FIXED32
        streams = [lan.frames(w, iteration, parts[w], precisions[w]) for w in range(workers)]
        want = reference(parts, precisions, 16)
        actions: list[Send | Completed | Summed] = []
        for frames in zip(*streams, strict=True):   # workers' frames interleaved
            for w, frame in enumerate(frames):
                now = lan.send(w, frame)
                for summed in (a for a in now if isinstance(a, Summed)):
                    # what every worker's frames covered is final at once: exactly the whole sum's values
                    for seq in range(summed.since, summed.upto):
                        t, c = lan.layout.locate(seq)
                        a, b = lan.layout.bounds(t, c)
                        assert np.array_equal(lan.core.partial(iteration, t, a, b), want[t][a:b])
                actions += now
        covered = [(a.since, a.upto) for a in actions if isinstance(a, Summed)]
        # the frontier moves once per frame all workers sent (the last worker's), in order, to the end
        assert [lo for lo, _ in covered] == [0] + [hi for _, hi in covered[:-1]]
        assert covered[-1][1] == lan.layout.num_chunks and len(covered) == len(streams[0])
        assert actions[-1] == Completed(iteration) and len(actions) == len(covered) + 1
        if iteration == 5:
            assert streams[0][0][0].wide
        sums = lan.core.take(iteration)
        for got, expected in zip(sums, want, strict=True):
            assert np.array_equal(got, expected)


def assembly_target(assembly: ResultAssembly) -> Callable[[Frame, int], memoryview | None]:
    def expect(message: Frame, n: int) -> memoryview | None:
        assert isinstance(message, Result)
        return assembly.target(message, n)

    return expect


def test_results_go_to_every_worker_under_its_own_token_and_assemble_in_place() -> None:
    lan = Lan(3)
    result = [np.arange(s, dtype=np.float32) * 0.5 for s in SIZES]
    sends = lan.core.results(9, result, total=7)
    assert {s.conn for s in sends} == {0, 1, 2}
    for worker in range(3):
        assembly = ResultAssembly(SIZES, lan.core.segment, lan.tokens, worker)
        assembly.begin(9)
        reader = FrameReader(assembly_target(assembly), max_payload=tcpwire.MAX_RESULT_PAYLOAD)
        stream = b"".join(s.header + bytes(s.payload) for s in sends if s.conn == worker)
        done: list[bool] = []
        feed(reader, stream, 65536, lambda m, a=assembly, d=done: d.append(a.received(m)))
        assert done[-1] and not any(done[:-1]) and assembly.total == 7
        for got, want in zip(assembly.arrays, result, strict=True):
            assert np.array_equal(got, want)
    other = ResultAssembly(SIZES, lan.core.segment, lan.tokens, 0)
    other.begin(9)
    with pytest.raises(WireError, match="token"):   # worker 1's copy is not worker 0's
        assembly_target(other)(tcpwire.decode_header(sends[-1].header[tcpwire.PREFIX.size:]), len(sends[-1].payload))


def test_forged_and_malformed_frames_are_refused_with_the_reason() -> None:
    lan = Lan(2)
    good = lan.frames(0, 4, [np.ones(s, np.float32) for s in SIZES], Precision.FIXED32)
    with pytest.raises(Refuse, match="not its own") as info:
        lan.send(0, lan.frames(0, 4, [np.ones(s, np.float32) for s in SIZES], Precision.FIXED32, token=12345)[0])
    assert info.value.reason is Refused.FORGED
    with pytest.raises(Refuse, match="naming worker 0 on worker 1") as info:
        lan.send(1, good[0])
    assert info.value.reason is Refused.FORGED
    with pytest.raises(Refuse, match="payload of 3 bytes") as info:
        lan.send(0, (good[0][0], b"abc"))
    assert info.value.reason is Refused.MALFORMED
    with pytest.raises(Refuse, match="expected tensor 0 from 0") as info:
        lan.send(0, good[1])
    assert info.value.reason is Refused.PROTOCOL
    with pytest.raises(Refuse, match="without its token"):
        lan.hello(1, nonce=5, conn=9, token=77)
    with pytest.raises(Refuse, match="replays nonce"):
        lan.hello(1, nonce=1001, conn=9)
    with pytest.raises(Refuse, match="DATA before HELLO"):
        lan.core.expect(10, good[0][0], len(good[0][1]))
    nan = msgspec.structs.replace(good[0][0], precision=int(Precision.FP16))
    payload = np.full(nan.count, np.nan, "<f2").tobytes()
    lan.core.expect(0, nan, len(payload))
    with pytest.raises(Refuse, match="inf/nan"):
        lan.core.on_frame(0, nan, memoryview(payload), 0.0)
    assert lan.core.refuse(0, Refuse(Refused.FORGED, "x")).header.endswith(b"forged\xa1x")


def test_a_silent_worker_is_named_and_the_open_iterations_stay_bounded() -> None:
    lan = Lan(3)
    for iteration in range(WINDOW):
        lan.send(0, lan.frames(0, iteration, [np.ones(s, np.float32) for s in SIZES], Precision.FIXED32)[0])
    with pytest.raises(Refuse, match="not open"):
        lan.send(0, lan.frames(0, WINDOW, [np.ones(s, np.float32) for s in SIZES], Precision.FIXED32)[0])
    error = lan.core.timed_out(0, 1.5)
    assert "missing workers [0, 1, 2]" in str(error)
    lan.core.closed(2)
    assert "(2 not connected)" not in str(lan.core.timed_out(1, 1.0))
    assert "[2] not connected" in str(lan.core.timed_out(2, 1.0))
    lan.send(0, lan.frames(0, WINDOW, [np.ones(s, np.float32) for s in SIZES], Precision.FIXED32)[0])   # room again


def test_values_no_lane_holds_are_refused_at_the_worker() -> None:
    with pytest.raises(WireError, match="beyond fixed point"):
        encode_data(np.array([np.inf], np.float32), Precision.FIXED32, 16, LANES)
    with pytest.raises(WireError, match="inf or nan"):
        encode_data(np.array([np.nan], np.float32), Precision.INT8, 16, LANES)


def test_welcome_frames_must_be_whole_chunks() -> None:
    with pytest.raises(WireError, match="multiple"):
        Welcome(0, 1, 2, (16,), 357, 1000)


# --- edge_mode=auto ------------------------------------------------------------------------------


def test_auto_takes_the_fastest_exact_path() -> None:
    got = pick({"xdp": Measured(1.4, True, 7.7), "userspace": Measured(0.2, True, 34.0),
                "tcp": Measured(2.1, True, 3.0)})
    assert got.path == "tcp" and "fastest" in got.reason
    assert pick({"xdp": Measured(1.4, True, 7.7), "tcp": Measured(2.1, False, 3.0)}).path == "xdp"
    failed = pick({"xdp": Measured(None, False, error="cannot load"), "userspace": Measured(0.2)})
    assert failed.path == "userspace"


def test_auto_takes_the_leaner_of_two_paths_within_the_tie() -> None:
    got = pick({"xdp": Measured(2.0, True, 8.0), "tcp": Measured(1.95, True, 3.0)})
    assert got.path == "tcp" and "less host CPU" in got.reason
    assert pick({"xdp": Measured(2.0, True, 8.0), "tcp": Measured(1.5, True, 3.0)}).path == "xdp"


def test_auto_leaves_tcp_out_where_it_cannot_serve_and_falls_back_when_nothing_ran() -> None:
    assert candidates(clustered=True) == ("xdp", "userspace")
    assert candidates(compressed=True) == ("xdp", "userspace")
    assert candidates() == ("xdp", "userspace", "tcp")
    measured = {"xdp": Measured(1.0), "userspace": Measured(0.5), "tcp": Measured(3.0)}
    assert pick(measured, candidates(clustered=True)).path == "xdp"
    nothing = pick({"xdp": Measured(None, False, error="EPERM")})
    assert nothing.path == FALLBACK and "EPERM" in nothing.reason


def test_the_gateway_role_runs_the_tcp_path_and_refuses_it_for_two_levels() -> None:
    from bpf.gateway import EdgeOptions, GatewayRole
    from bpf.tcpagent import TcpEdgeAgent
    from netstorm.errors import ConfigError
    from netstorm.lan.deploy import LanTopology

    with pytest.raises(ConfigError, match="one level"):
        EdgeOptions(workers=3, listen=("127.0.0.1", 0), mode="tcp", topology=LanTopology(3, {0: (1,)}))
    role = GatewayRole(EdgeOptions(workers=2, listen=("127.0.0.1", 0), mode="tcp"), iteration_timeout=5.0)
    agent = role._start([10, 20])
    try:
        assert isinstance(agent, TcpEdgeAgent) and role.mode == "tcp"
        assert agent.layout.sizes == (10, 20)
    finally:
        agent.sock.close()
