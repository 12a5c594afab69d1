"""Results from the kernel (``edge_results=kernel``): the gateway's XDP program turns the datagram that completes
a slot into the RESULT of its chunk for the workers' multicast group, and shadow slots keep every result
until each worker has it.

Here: the program's rewrite, run with BPF_PROG_TEST_RUN (the frame it sends, its token, the lanes' exact sum,
a re-emission, an overflowed slot going up to the agent instead, the iteration's report); the worker's
conversion of fixed-point results against the agent's; and the shadow-slot argument itself, as a model
driven by ``EdgeLayout``'s own slot numbers and window, with any order of deliveries and any lost results.
The runs in namespaces are in tests/test_edge_levels.py."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netstorm.lan.batch import dequantize_into
from netstorm.lan.fixedpoint import dequantize_rows
from netstorm.lan.header import HEADER_BYTES, NEED_NONE, Flag, Header, Kind, Precision, lanes_of
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import data_packets
from netstorm.lan.resultwire import ResultWire

LANES = 358
JOB = 21
PORT = 9620
GROUP = ("239.77.0.21", 9621)
OWN = ("10.0.0.1", PORT)
OWN_MAC = bytes.fromhex("020000000001")
LAYOUT = EdgeLayout((LANES * 3,), (12,), lanes=LANES, pool=4, shadow=True)
"""3 chunks per iteration through 4 shadow slots (2 per worker in flight)."""


def test_shadow_layouts_number_slots_on_across_iterations() -> None:
    assert LAYOUT.num_slots == 4 and LAYOUT.window == 2
    seqs = np.arange(LAYOUT.num_chunks)
    # iteration k's chunks continue where k - 1's stopped: one sequence round the pool
    flat = np.concatenate([LAYOUT.slot_numbers(seqs, k) for k in range(5)])
    np.testing.assert_array_equal(flat, np.arange(flat.size) % 4)
    plain = EdgeLayout((LANES * 3,), (12,), lanes=LANES, pool=4)
    np.testing.assert_array_equal(plain.slot_numbers(seqs, 7), seqs % 3)
    assert plain.window == plain.num_slots == 3
    # without a pool the shadow pool is two models' worth of chunks; a pool caps it
    assert EdgeLayout((LANES * 3,), (12,), lanes=LANES, shadow=True).num_slots == 6
    assert EdgeLayout((LANES * 3,), (12,), lanes=LANES, pool=5, shadow=True).num_slots == 5


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(1, 5), chunks=st.integers(1, 9), pool=st.integers(2, 12), iterations=st.integers(1, 4),
       data=st.data())
def test_a_shadow_slot_is_taken_over_only_once_every_worker_has_its_result(workers: int, chunks: int, pool: int,
                                                                           iterations: int, data: Any) -> None:
    """The protocol as a model, with the layout's own slot numbers and window: workers send when their window
    allows, the aggregator completes slots, results reach each worker or are lost, and a worker missing a
    result resends its DATA, for which a completed slot sends the result again. In whatever order that
    happens, a newer chunk never takes a slot over before every worker had the result of the chunk in it,
    and every worker ends with every result."""
    lay = EdgeLayout((chunks,), (0,), lanes=1, pool=pool, shadow=True)
    total = chunks * iterations
    key_of = [(k, c) for k in range(iterations) for c in range(chunks)]
    slot_of = [int(lay.slot_numbers(c, k)) for k, c in key_of]
    sent = [0] * workers                          # the next chunk (global number) each worker sends
    got = [set[int]() for _ in range(workers)]     # results each worker holds
    slot_key: dict[int, int] = {}                 # slot -> global chunk number it holds
    slot_bits: dict[int, set[int]] = {}
    in_flight: list[tuple[int, int]] = []         # DATA (worker, chunk) on its way
    results: list[tuple[int, int]] = []           # results (worker, chunk) on their way

    def may_send(w: int) -> bool:
        g = sent[w]
        if g >= total:
            return False
        k = g // chunks
        if any(j not in got[w] for j in range(k * chunks)):   # a worker starts an iteration with all of the last
            return False
        return g % chunks < lay.window or (g - lay.window) in got[w]

    def deliver_data(i: int) -> None:
        w, g = in_flight.pop(i)
        s = slot_of[g]
        held = slot_key.get(s)
        if held is None or held < g:            # a newer key takes the slot over
            if held is not None:
                assert all(held in got[v] for v in range(workers)), (held, g, got)
            slot_key[s], slot_bits[s] = g, set()
        if slot_key[s] != g:                    # an older key's DATA: a straggler, dropped
            return
        if w not in slot_bits[s]:
            slot_bits[s].add(w)
            if len(slot_bits[s]) == workers:    # complete: the result to the group
                results.extend((v, g) for v in range(workers))
        elif len(slot_bits[s]) == workers:      # its sender lacks the result: sent to the group again
            results.extend((v, g) for v in range(workers))

    def lacking(w: int) -> list[int]:
        return [j for j in range(sent[w]) if j not in got[w]]

    for _ in range(10 * total * workers):      # any order, any result lost
        choices = [("send", w) for w in range(workers) if may_send(w)]
        choices += [("data", i) for i in range(len(in_flight))]
        choices += [("result", i) for i in range(len(results))]
        choices += [("resend", w) for w in range(workers) if lacking(w)]
        if not choices:
            break
        action, i = data.draw(st.sampled_from(choices))
        if action == "send":
            in_flight.append((i, sent[i]))
            sent[i] += 1
        elif action == "resend":                # the oldest chunk whose result this worker lacks, again
            in_flight.append((i, lacking(i)[0]))
        elif action == "data":
            deliver_data(i)
        else:
            w, g = results.pop(i)
            if data.draw(st.booleans()):        # delivered (else lost)
                got[w].add(g)
    for _ in range(4 * total + 4):              # then nothing more is lost: everyone finishes
        while in_flight:
            deliver_data(0)
        while results:
            w, g = results.pop(0)
            got[w].add(g)
        for w in range(workers):
            in_flight.extend((w, j) for j in lacking(w)[:1])
            while may_send(w):
                in_flight.append((w, sent[w]))
                sent[w] += 1
    assert all(len(g) == total for g in got)


def test_fixed_point_results_convert_as_the_agent_converts_its_sums() -> None:
    rng = np.random.default_rng(3)
    raw = rng.integers(-(2**31) + 1, 2**31 - 1, (40, 16)).astype(np.int32)
    scales = rng.integers(-20, 40, 40)
    want = dequantize_rows(raw, scales)
    # rows taken in runs, out of order and repeated, as a batch of results arrives
    order = np.concatenate([np.arange(5, 20), np.arange(0, 5), np.arange(20, 40), [7, 7]])
    src = np.flatnonzero(np.ones(order.size, bool))
    batch = raw[order]
    out = np.full((40, 16), np.nan, np.float32)
    dequantize_into(out, order, batch, src, scales[order])
    np.testing.assert_array_equal(out, want)
    many = rng.permutation(40)                    # past RUN_SEGMENTS stretches: gathered and scattered
    out2 = np.full((40, 16), np.nan, np.float32)
    dequantize_into(out2, many, raw[many], np.arange(40), scales[many])
    np.testing.assert_array_equal(out2, want)
    # a result format of float32 lanes admits them, alongside float32 lanes themselves
    allowed = ResultWire.float32(LAYOUT).allowed()
    assert allowed[0, Precision.SCALED32] and allowed[0, Precision.FIXED32] and not allowed[0, Precision.INT32]


@pytest.fixture(scope="module")
def program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=0b11, timeout=5.0)
    yield agg
    agg.close()


def _frame(datagram: bytes, src: str) -> bytes:
    from bpf.xdp import udp_frame

    return udp_frame(datagram, dport=PORT, src=src)


def _checksum_ok(ip: bytes) -> bool:
    total = sum(word for (word,) in struct.iter_unpack("!H", ip))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


@pytest.mark.root
@pytest.mark.bcc
def test_the_program_sends_a_completed_slot_to_the_group_as_its_result(program: Any) -> None:
    from bpf.xdp import XDP_DROP, XDP_PASS, XDP_TX, KernelResults, multicast_mac
    from netstorm.lan.slots import GROUP_TOKENS, ITERATION_DONE
    from netstorm.lan.tokens import LanTokens

    tokens = LanTokens(b"s" * 32, JOB)
    agg_token = 0x5EC
    iteration = 9
    program.return_results(KernelResults(group=GROUP, group_mac=multicast_mac(GROUP[0]), own=OWN, own_mac=OWN_MAC,
                                         total=2, chunks=LAYOUT.num_chunks))
    program.require_tokens(agg_token)
    try:
        program.install_tokens([(w, iteration, tokens.worker(w, iteration)) for w in range(2)])
        rng = np.random.default_rng(1)
        values = [rng.standard_normal(LAYOUT.sizes[0]).astype(np.float32) for _ in range(2)]
        rows = [data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=0, values=values[w],
                             token=tokens.worker(w, iteration)) for w in range(2)]
        # no group token installed yet: the completing datagram is dropped, counted, and nothing leaves
        assert program.test_run(_frame(rows[0][0].tobytes(), "10.0.0.10"))[0] == XDP_DROP
        before = program.stats()
        assert program.test_run(_frame(rows[1][0].tobytes(), "10.0.0.11"))[0] == XDP_DROP
        assert program.stats()["bad_token"] == before["bad_token"] + 1
        program.install_tokens([(GROUP_TOKENS, iteration, tokens.group(iteration))])
        verdict, frame = program.test_run(_frame(rows[1][0].tobytes(), "10.0.0.11"))   # sent again
        assert verdict == XDP_TX
        eth, ip, udp, payload = frame[:14], frame[14:34], frame[34:42], frame[42:]
        assert eth[:6] == multicast_mac(GROUP[0]) == bytes.fromhex("01005e4d0015") and eth[6:12] == OWN_MAC
        assert ip[12:16] == socket.inet_aton(OWN[0]) and ip[16:20] == socket.inet_aton(GROUP[0])
        assert _checksum_ok(ip)
        assert struct.unpack("!HH", udp[:4]) == (PORT, GROUP[1])
        head = Header.decode(payload)
        assert (head.kind, head.precision, head.total, head.token) == (
            Kind.RESULT, Precision.SCALED32, 2, tokens.group(iteration))
        assert (head.iteration, head.tensor, head.chunk, head.scale, head.need) == (iteration, 0, 0, 12, NEED_NONE)
        want = np.sum([lanes_of(r[0].tobytes()).astype(np.int64) for r in rows], axis=0)
        np.testing.assert_array_equal(lanes_of(payload)[:head.count], want[:head.count])
        assert len(payload) == HEADER_BYTES + 4 * LANES
        # a worker that lost it sends its DATA again: the same result, again, not counted twice
        again = program.stats()
        verdict, frame2 = program.test_run(_frame(rows[0][0].tobytes(), "10.0.0.10"))
        assert verdict == XDP_TX and frame2[42:] == payload
        after = program.stats()
        assert after["reemit"] == again["reemit"] + 1 and after["result"] == again["result"] + 1
        # the iteration's other chunks: the last one's result comes with the program's report
        for chunk in (1, 2):
            for w in range(2):
                program.test_run(_frame(rows[w][chunk].tobytes(), f"10.0.0.1{w}"))
        events = program.poll_events(1000)
        assert [(e.iteration, e.slot) for e in events] == [(iteration, ITERATION_DONE)]
        assert program.completed_chunks(iteration) == LAYOUT.num_chunks
        assert program.stats()["iteration_done"] == before["iteration_done"] + 1
        # a slot whose sum left int32 is never sent out as a result: it goes up to the agent as AGG
        nxt = iteration + 1
        program.install_tokens([(w, nxt, tokens.worker(w, nxt)) for w in range(2)] +
                               [(GROUP_TOKENS, nxt, tokens.group(nxt))])
        big = np.full(LAYOUT.sizes[0], 2.0**18 * 1.5, np.float32)      # fits at scale 12; two do not
        hot = [data_packets(LAYOUT, job=JOB, worker=w, iteration=nxt, tensor=0, values=big,
                            token=tokens.worker(w, nxt))[0].tobytes() for w in range(2)]
        program.test_run(_frame(hot[0], "10.0.0.10"))
        verdict, frame = program.test_run(_frame(hot[1], "10.0.0.11"))
        up = Header.decode(frame[42:])
        assert verdict == XDP_PASS and up.kind == Kind.AGG and up.flags & Flag.OVERFLOW
        assert up.token == agg_token
        # a chunk completes while the one before it still lacks worker 1 (its datagram lost): the program reports
        # that slot at once, as its timer would later, so the agent NACKs worker 1 now
        later = nxt + 1
        program.install_tokens([(w, later, tokens.worker(w, later)) for w in range(2)] +
                               [(GROUP_TOKENS, later, tokens.group(later))])
        rows = [data_packets(LAYOUT, job=JOB, worker=w, iteration=later, tensor=0, values=values[w],
                             token=tokens.worker(w, later)) for w in range(2)]
        program.poll_events(0)
        program.test_run(_frame(rows[0][0].tobytes(), "10.0.0.10"))
        for w in range(2):
            program.test_run(_frame(rows[w][1].tobytes(), f"10.0.0.1{w}"))
        program.test_run(_frame(rows[0][2].tobytes(), "10.0.0.10"))   # chunk 1 completed: reported once only
        program.test_run(_frame(rows[1][2].tobytes(), "10.0.0.11"))
        gaps = [e for e in program.poll_events(1000) if e.slot != ITERATION_DONE]
        assert [(e.iteration, e.chunk, e.slot, e.missing) for e in gaps] == [
            (later, 0, int(LAYOUT.slot_numbers(0, later)), [1])]
    finally:
        program.return_results(None)
        program.require_tokens(0)


def test_a_shadow_pool_needs_two_slots() -> None:
    from netstorm.lan.errors import WireError

    with pytest.raises(WireError, match="at least 2"):
        EdgeLayout((LANES * 3,), (12,), lanes=LANES, pool=1, shadow=True)
    assert EdgeLayout((LANES,), (12,), lanes=LANES, shadow=True).num_slots == 2   # one chunk: two slots


@pytest.mark.root
@pytest.mark.bcc
def test_results_from_the_kernel_refuse_what_only_the_agent_can_do(program: Any) -> None:
    """A planned round (a compressed job's) and a live re-deployment need the agent's result path; results from
    the kernel are chosen before any worker is told its deployment; the program's count of an iteration's
    completed chunks is readable, which is how a lost report is recovered."""
    from bpf.agent import EdgeAgent
    from bpf.xdp import KernelResults, multicast_mac
    from netstorm.lan.deploy import LanTopology

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        agent = EdgeAgent(sock, LAYOUT, workers=2, job=JOB, mode="xdp", xdp=program, group=GROUP)
        try:
            agent.return_results_from_kernel(OWN_MAC)
            # the program is configured from the agent's own group, address, workers and layout
            assert program.results == KernelResults(group=GROUP, group_mac=multicast_mac(GROUP[0]),
                                                    own=sock.getsockname(), own_mac=OWN_MAC, total=2,
                                                    chunks=LAYOUT.num_chunks)
            assert agent.deployment(0) is not None and agent.deployment(0).kernel_results   # type: ignore[union-attr]
            with pytest.raises(ValueError, match="planned round"):
                agent.plan(3, LAYOUT)
            with pytest.raises(ValueError, match="re-deployment"):
                agent.redeploy(LanTopology.parse("0:1", 2), 3)
            assert program.completed_chunks(123457) == 0     # never seen
            late = EdgeAgent(sock, LAYOUT, workers=2, job=JOB, mode="xdp", xdp=program, group=GROUP)
            late.addresses[0] = ("127.0.0.1", 1)
            with pytest.raises(ValueError, match="before any worker"):
                late.return_results_from_kernel(OWN_MAC)
        finally:
            program.return_results(None)
