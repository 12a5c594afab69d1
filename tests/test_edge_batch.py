"""Datagrams taken a batch at a time (netstorm/lan/batch.py, udp.receive_batch) and the whole-tensor fp32
datagram builder: the batch parse accepts exactly what ``Header.decode`` accepts and reads the same fields,
a worker's and the agent's batched handling give what the per-datagram handling gave, a malformed or
hostile datagram in a batch is rejected without touching the others, and a batch never holds more than
its rows."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpf.agent import EdgeAgent
from netstorm.lan import udp
from netstorm.lan.batch import ROW_BYTES, DatagramBatch, valid_headers
from netstorm.lan.errors import WireError
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.header import FIELDS, HEADER_BYTES, OFFSETS, TOKEN_AT, Flag, Header, Kind, Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import ack_packets, control_packet, data_packets, nack_packets, result_packets, with_token
from netstorm.lan.senderactions import Done
from netstorm.lan.sendercore import SenderCore
from netstorm.lan.sendwindow import SendWindow
from netstorm.lan.tokens import LanTokens
from tests.lan_gateway import KernelMaps, hello, sent
from tests.test_edge_fuzz import datagrams

LAYOUT = EdgeLayout.uniform([1000, 7], scale=10, lanes=64)
JOB = 5
SECRET = b"s" * 32


def batch_of(items: list[bytes], rows: int = 64) -> DatagramBatch:
    batch = DatagramBatch(rows)
    for data in items:
        assert batch.put(data)
    return batch


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(datagrams(), min_size=1, max_size=12))
def test_the_batch_parse_accepts_exactly_what_the_decoder_accepts(items: list[bytes]) -> None:
    batch = batch_of(items)
    heads = batch.headers()
    ok = valid_headers(heads, batch.lengths)
    for i, data in enumerate(items):
        try:
            head = Header.decode(data)
        except WireError:
            assert not ok[i], f"datagram {i} ({len(data)} bytes) passed the batch parse, the decoder refused it"
            continue
        assert ok[i], f"datagram {i}: the decoder took {head}, the batch parse refused it"
        for f in FIELDS:   # every field reads the same through the structured view
            if f.name not in ("magic", "version"):
                assert int(heads[f.name][i]) == int(getattr(head, f.name)), f.name


def _set(data: bytes, field: str, value: int) -> bytes:
    """``data`` with one header field replaced."""
    ctype = next(f.ctype for f in FIELDS if f.name == field)
    width = {"u8": 1, "s8": 1, "u16": 2, "u32": 4, "u64": 8}[ctype]
    at = OFFSETS[field]
    return data[:at] + value.to_bytes(width, "little", signed=ctype == "s8") + data[at + width:]


def test_every_rule_of_the_decoder_refuses_its_row_and_only_that_row() -> None:
    """One datagram per rule of ``Header.decode``, each just past its limit, in one batch with good ones."""
    data = data_packets(LAYOUT, job=JOB, worker=2, iteration=3, tensor=1, values=np.ones(7))[0].tobytes()
    result = result_packets(LAYOUT, job=JOB, iteration=3, tensor=1, values=np.ones(7), total=2)[0].tobytes()
    half = data_packets(LAYOUT, job=JOB, worker=2, iteration=3, tensor=1, values=np.ones(7),
                        precision=Precision.FP16)[0].tobytes()
    nack = control_packet(Kind.NACK, job=JOB, worker=1)
    listed = nack_packets(np.array([4, 9]), job=JOB, iteration=3)[0]
    hello = control_packet(Kind.HELLO, job=JOB, worker=1)
    bad = {
        "short": data[: HEADER_BYTES - 1],
        "magic": _set(data, "magic", 0x534F),
        "version": _set(data, "version", 2),
        "kind 0": _set(nack, "kind", 0),
        "kind 12": _set(nack, "kind", 12),
        "count 1025": _set(data, "count", 1025),
        "worker 64": _set(data, "worker", 64),
        "precision 4": _set(data, "precision", 4),
        "fp16 RESULT": _set(result, "precision", 1),
        "payload not lanes": data + b"\0\0",
        "payload short of count": _set(data, "count", 65),
        "payload past MAX_LANES": half + b"\0" * (2 * 1025 - (len(half) - HEADER_BYTES)),
        "HELLO payload": hello + b"\0" * 1025,
        "REPORT payload": _set(nack, "kind", Kind.REPORT) + b"\0" * 65,
        "PULL payload": _set(nack, "kind", Kind.PULL) + b"\0" * 4,
        "RESCALE NACK payload": _set(nack, "flags", int(Flag.RESCALE)) + b"\0" * 4,
        "RESCALE NACK lanes": _set(_set(listed, "flags", int(Flag.RESCALE)), "count", 1),
        "NACK short of count": _set(listed, "count", 3),
        "flags 8": _set(data, "flags", 8),
        "total on DATA": _set(data, "total", 1),
    }
    good = [data, half, result, nack, listed, _set(nack, "flags", int(Flag.RESCALE)),
            hello + b"\0" * 1024, _set(nack, "kind", Kind.REPORT) + b"\0" * 64,
            _set(data, "flags", 7), _set(data, "worker", 63)]
    for name, item in bad.items():
        with pytest.raises(WireError):
            Header.decode(item)
        assert not valid_headers(batch_of([item]).headers(), batch_of([item]).lengths)[0], name
    for item in good:
        Header.decode(item)
    items = [x for pair in zip(good * 3, bad.values(), strict=False) for x in pair]
    batch = batch_of(items)
    expected = [_decodes(x) for x in items]
    assert valid_headers(batch.headers(), batch.lengths).tolist() == expected


def _decodes(data: bytes) -> bool:
    try:
        Header.decode(data)
    except WireError:
        return False
    return True


def test_truncated_and_oversized_rows_are_refused() -> None:
    good = result_packets(LAYOUT, job=JOB, iteration=1, tensor=1, values=np.arange(7.0), total=2)[0].tobytes()
    batch = batch_of([good, good[: HEADER_BYTES - 1], good + b"\0" * (ROW_BYTES + 8 - len(good))])
    assert valid_headers(batch.headers(), batch.lengths).tolist() == [True, False, False]


def test_a_batch_holds_at_most_its_rows_and_the_kernel_keeps_the_rest() -> None:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        tx.bind(("127.0.0.1", 0))
        sent = [control_packet(Kind.PULL, job=JOB, worker=1, iteration=k, chunk=k) for k in range(40)]
        for data in sent:
            tx.sendto(data, rx.getsockname())
        tx.sendto(b"\x01" * (ROW_BYTES + 100), rx.getsockname())   # longer than a row
        batch = DatagramBatch(16)
        got: list[bytes] = []
        lengths: list[int] = []
        deadline = time.monotonic() + 10
        while len(lengths) < 41 and time.monotonic() < deadline:
            batch.clear()
            n = udp.receive_batch(rx, batch)
            assert n == batch.count <= 16
            got += [batch.datagram(i) for i in range(n)]
            lengths += batch.lengths[:n].tolist()
            assert all(batch.address(i) == tx.getsockname() for i in range(n))
        assert got[:40] == sent and lengths[40] > ROW_BYTES
        batch.clear()
        assert udp.receive_batch(rx, batch) == 0   # nothing left, and no wait
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("size,lanes,scale", [(1000, 64, 10), (7, 64, 0), (4096, 357, 20), (5000, 1, -3),
                                              (3000, 800, 120), (2000, 100, -128)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_whole_tensor_datagrams_are_the_general_path_bit_for_bit(size: int, lanes: int, scale: int,
                                                                  dtype: type) -> None:
    layout = EdgeLayout.uniform([size], scale=scale, lanes=lanes)
    rng = np.random.default_rng(size + lanes)
    values = (rng.standard_normal(size) * np.exp2(rng.integers(-150, 110, size) / 2)).astype(np.float32)
    values[rng.random(size) < 0.2] = 0.0
    values[: min(size, lanes)] = 0.0           # an all-zero chunk (need = NEED_NONE)
    values[-1] = 3e38                          # an overflowing chunk at any scale above -97
    values = values.astype(dtype)
    fast = data_packets(layout, job=JOB, worker=3, iteration=9, tensor=0, values=values, token=77)
    general = data_packets(layout, job=JOB, worker=3, iteration=9, tensor=0, values=values, token=77,
                           chunks=np.arange(layout.chunks[0]))
    assert fast.shape == general.shape and np.array_equal(fast, general)
    assert Header.decode(fast[-1].tobytes()).flags & Flag.OVERFLOW or scale < -97


def test_whole_tensor_datagrams_refuse_inf_and_nan() -> None:
    for bad in (np.inf, np.nan):
        values = np.ones(1000, np.float32)
        values[500] = bad
        with pytest.raises(WireError, match="inf or nan"):
            data_packets(LAYOUT, job=JOB, worker=0, iteration=1, tensor=0, values=values)


@pytest.fixture
def core() -> SenderCore:
    return SenderCore(worker=2, job=JOB, tokens=LanTokens(SECRET, JOB))


def pushing(core: SenderCore, iteration: int) -> SenderCore:
    """``core`` sending zeros for ``iteration`` (its first window's DATA taken), at time 0."""
    core.push(iteration, [np.zeros(s, np.float32) for s in LAYOUT.sizes], layout=LAYOUT, now=0.0, timeout=60.0)
    core.actions()
    return core


def _results(iteration: int, values: list[np.ndarray], token: int) -> list[bytes]:
    rows = [result_packets(LAYOUT, job=JOB, iteration=iteration, tensor=t, values=v, total=3)
            for t, v in enumerate(values)]
    return [r.tobytes() for part in rows for r in with_token(part, token)]


def _hostile(genuine: bytes) -> list[bytes]:
    """Variants of a genuine RESULT that must change nothing: each field a forger or a fault could get wrong."""
    def patched(field: str, value: int) -> bytes:
        at = OFFSETS[field]
        width = {"u8": 1, "s8": 1, "u16": 2, "u32": 4, "u64": 8}[next(f.ctype for f in FIELDS if f.name == field)]
        return genuine[:at] + value.to_bytes(width, "little", signed=value < 0) + genuine[at + width:]

    return [genuine[:HEADER_BYTES - 2],                       # short
            patched("magic", 0x1234), patched("version", 9),  # foreign
            patched("job", JOB + 1), patched("iteration", 99),  # another job, another iteration
            patched("token", 12345),                          # forged
            patched("tensor", 7), patched("chunk", 500),      # no such chunk
            patched("count", 3),                              # lanes do not cover the chunk
            patched("count", 1024),                           # more lanes than the payload holds
            patched("flags", 0x80),                           # unknown flag
            genuine + b"\0" * 4096]                           # longer than any datagram


def test_results_scattered_in_a_batch_equal_the_values_and_hostile_rows_change_nothing(core: SenderCore) -> None:
    """In any order, with duplicates and hostile rows in the same batch: the result is the values, the total
    the datagrams say, and only the forged tokens count as forged."""
    tokens = LanTokens(SECRET, JOB)
    values = [np.arange(1000, dtype=np.float32) * 0.5 - 7, np.arange(7, dtype=np.float32) + 100]
    genuine = _results(4, values, tokens.group(4))
    poison = np.full(64, -1.0, np.float32).tobytes()
    hostile = [h for g in genuine[:3] for h in _hostile(g[:HEADER_BYTES] + poison)]
    items = genuine + genuine[:5] + hostile     # duplicates too
    order = np.random.default_rng(0).permutation(len(items))
    pushing(core, 4).datagrams_received(batch_of([items[i] for i in order], rows=len(items)), 0.001)
    outcome = core.outcome
    assert isinstance(outcome, Done) and outcome.iteration == 4 and outcome.total == 3
    for want, have in zip(values, outcome.result, strict=True):
        np.testing.assert_array_equal(have, want)
    assert core.forged == 3   # the forged tokens; every other variant is malformed or not ours


def test_a_result_batch_is_what_the_per_datagram_decode_gives(core: SenderCore) -> None:
    """Round trip against the per-datagram path: decode each, place its lanes by (tensor, chunk)."""
    tokens = LanTokens(SECRET, JOB)
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(1000).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    genuine = _results(8, values, tokens.gateway(2, 8))
    reference = [np.zeros(1000, np.float32), np.zeros(7, np.float32)]
    for data in genuine:
        head = Header.decode(data)
        start, stop = LAYOUT.bounds(head.tensor, head.chunk)
        reference[head.tensor][start:stop] = np.frombuffer(data, "<f4", offset=HEADER_BYTES)[: stop - start]
    pushing(core, 8).datagrams_received(batch_of(genuine), 0.001)
    assert isinstance(core.outcome, Done)
    for want, have in zip(reference, core.outcome.result, strict=True):
        np.testing.assert_array_equal(have, want)


def test_acks_of_a_batch_move_the_window_and_forged_ones_do_not(core: SenderCore) -> None:
    tokens = LanTokens(SECRET, JOB)
    acks = ack_packets(np.array([0, 3, 5]), job=JOB, iteration=6, per_packet=2)
    stamp = tokens.group(6).to_bytes(8, "little")
    genuine = [a[:TOKEN_AT] + stamp + a[TOKEN_AT + 8:] for a in acks]
    forged = ack_packets(np.array([1, 2]), job=JOB, iteration=6, token=999)
    # and one whose count overruns its payload
    pushing(core, 6).datagrams_received(batch_of(genuine + forged + [genuine[0][:-4]]), 0.001)
    assert core.window is not None and np.flatnonzero(core.window.acked).tolist() == [0, 3, 5]
    assert core.forged == 1


def test_the_window_opens_as_far_as_the_per_chunk_rule_says() -> None:
    """``sendable``: chunk j once j < pool or chunk j - pool was acknowledged (brute force)."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        chunks, pool = int(rng.integers(1, 60)), int(rng.integers(1, 20))
        flight = SendWindow(chunks, pool)
        flight.sent(0, min(chunks, int(rng.integers(0, chunks + 1))), 0.0)
        flight.acked[: flight.next] = rng.random(flight.next) < 0.7
        stop = flight.next
        while stop < chunks and (stop < pool or flight.acked[stop - pool]):
            stop += 1
        assert flight.sendable() == (flight.next, stop)


def _aggs(agg_token: int, iteration: int, sums: list[np.ndarray]) -> list[bytes]:
    out = []
    for t, s in enumerate(sums):
        rows = data_packets(LAYOUT, job=JOB, worker=0, iteration=iteration, tensor=t, values=s)
        rows[:, OFFSETS["kind"]] = int(Kind.AGG)
        out += [r.tobytes() for r in with_token(rows, agg_token)]
    return out


def test_the_agent_takes_a_batch_of_aggregates_and_rejects_the_bad_ones_alone() -> None:
    core = GatewayCore(LAYOUT, KernelMaps(LAYOUT), workers=3, job=JOB, userspace=False, port=0, secret=SECRET)
    core.expect(1)
    hello(core, 0, ("10.0.0.1", 5000), secret=SECRET)
    sent(core)
    rng = np.random.default_rng(1)
    sums = [np.rint(rng.standard_normal(1000) * 1e3) / 2**10, np.arange(7.0)]
    good = _aggs(core.agg_token, 1, sums)
    forged = good[0][:TOKEN_AT] + (core.agg_token ^ 1).to_bytes(8, "little") + good[0][TOKEN_AT + 8:]
    bad_chunk = good[1][:OFFSETS["chunk"]] + (900).to_bytes(4, "little") + good[1][OFFSETS["chunk"] + 4:]
    items = [forged, bad_chunk, good[0][:30], *good, good[2]]
    batch = batch_of(items)
    batch.names[:, :2] = np.frombuffer(socket.AF_INET.to_bytes(2, "little"), np.uint8)
    core.datagrams(batch, 5.0)
    result = core.book.sums(1)
    # the forged aggregate is counted as forged, the wrong chunk and the cut datagram as errors
    assert result.done and core.roster.forged == 1 and core.errors == 2
    assert result.first_at == result.done_at == 5.0   # the gateway's phase log reads these
    for want, have in zip(sums, result.result(), strict=True):
        np.testing.assert_array_equal(have, want.astype(np.float32))
    # every genuine aggregate is acknowledged once per copy received (the duplicate again)
    acked = [s for d, _ in sent(core) for s in np.frombuffer(d, "<u4", Header.decode(d).count, HEADER_BYTES).tolist()]
    assert sorted(acked) == sorted([*range(LAYOUT.num_chunks), 2])


def test_the_agent_drains_a_socket_in_batches() -> None:
    """Through the socket: valid aggregates complete the iteration, the rest go one by one to the
    per-datagram handler, which rejects them without losing the others."""
    sums = [np.arange(1000.0) / 4, np.ones(7)]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    async def play() -> None:
        agent = EdgeAgent(sock, LAYOUT, workers=3, job=JOB, mode="xdp", xdp=KernelMaps(LAYOUT),  # type: ignore[arg-type]
                          secret=SECRET)
        agent.expect(1)
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(agent.run())
            for data in [b"junk", *_aggs(agent.agg_token, 1, sums), control_packet(Kind.NACK, job=JOB, worker=0)]:
                tx.sendto(data, sock.getsockname())
            try:
                got = await agent.collect(1, timeout=10)
            finally:
                agent.close()
                await serving
        assert agent.errors == 2
        for want, have in zip(sums, got, strict=True):
            np.testing.assert_array_equal(have, np.asarray(want, np.float32))

    try:
        asyncio.run(play())
    finally:
        tx.close()
        sock.close()


def test_coalesced_datagrams_are_cut_back_into_rows() -> None:
    """A GSO send to a socket with UDP_GRO arrives whole (on loopback as over the bridge); its segments,
    the shorter last one too, come back as the datagrams sent, in order."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        tx.bind(("127.0.0.1", 0))
        assert udp.enable_gro(rx), "UDP_GRO (Linux 5.0) is refused"
        sent = [bytes([k]) * 1000 for k in range(40)] + [b"\x07" * 300]
        payload = b"".join(sent)
        tx.sendmsg([payload], [(socket.SOL_UDP, udp.UDP_SEGMENT, (1000).to_bytes(2, "little"))], 0,
                   rx.getsockname())
        tx.sendto(b"single", rx.getsockname())
        batch = DatagramBatch(256)
        deadline = time.monotonic() + 10
        while batch.count < len(sent) + 1 and time.monotonic() < deadline:
            udp.receive_batch(rx, batch, gro=True)
        assert [batch.datagram(i) for i in range(batch.count)] == [*sent, b"single"]
        assert batch.coalesced == 1
        assert batch.address(0) == batch.address(batch.count - 1) == tx.getsockname()
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("gso,mmsg", [(False, True), (False, False), (True, True)],
                         ids=["sendmmsg", "sendto-fallback", "gso"])
def test_rows_leave_as_separate_datagrams_a_window_per_call_or_as_gso_batches(
        gso: bool, mmsg: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Towards a cluster aggregator (``gso`` off) every row leaves as its own datagram, SEND_BATCH per
    ``sendmmsg`` (one ``sendto`` each only without it): the receiver, with UDP_GRO on, gets each alone, in
    order, where a GSO send reaches it whole (the batch a generic-mode XDP program never sees)."""
    from netstorm.lan.sender import receive_buffer

    if not mmsg:
        monkeypatch.setattr(udp, "_SENDMMSG", None)
    assert udp._SENDMMSG is not None or not mmsg, "libc has no sendmmsg"
    rows = np.random.default_rng(3).integers(0, 256, (udp.SEND_BATCH + 44, 64), dtype=np.uint8)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receive_buffer(rx, 8 << 20)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        assert udp.enable_gro(rx), "UDP_GRO (Linux 5.0) is refused"
        tx.bind(("127.0.0.1", 0))
        tx.setblocking(False)
        sender = udp.BatchSender(tx, gso=gso)
        asyncio.run(sender.send(rows[::-1][::-1], rx.getsockname()))   # a view, as a window's rows are
        batch = DatagramBatch(1024)
        deadline = time.monotonic() + 10
        while batch.count < len(rows) and time.monotonic() < deadline:
            udp.receive_batch(rx, batch, gro=True)
        assert [batch.datagram(i) for i in range(batch.count)] == [bytes(r) for r in rows]
        assert sender.datagrams == len(rows)
        if gso:
            assert batch.coalesced > 0 and sender.calls == -(-len(rows) // udp.GSO_SEGMENTS)
        else:
            assert batch.coalesced == 0
            assert sender.calls == (2 if mmsg else len(rows))
    finally:
        rx.close()
        tx.close()
