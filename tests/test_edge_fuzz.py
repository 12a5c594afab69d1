"""Every decoder of the LAN tier under random input: the header codec, the userspace aggregator's DATA path
and the agent's datagram handler either take a datagram, drop it, or raise the typed WireError; no other
exception escapes, with and without a job secret."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpf.agent import EdgeAgent
from bpf.fallback import UserspaceAggregator
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, HEADER_STRUCT, MAGIC, VERSION, Header, Kind
from netstorm.lan.layout import EdgeLayout

LAYOUT = EdgeLayout.uniform([1000, 7], scale=10, lanes=64)
JOB = 5
SECRET = b"f" * 32
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])

u8, u16, u32 = (st.integers(0, 2**n - 1) for n in (8, 16, 32))
s8 = st.integers(-128, 127)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def headers(draw: st.DrawFn, kind: st.SearchStrategy[int] = u8, job: st.SearchStrategy[int] = u16) -> bytes:
    """A header whose magic and version are right (so decoding goes past them) and every other field is
    drawn: small values that hit the limits often, any value sometimes."""
    small = st.one_of(st.integers(0, 70), u32)
    return HEADER_STRUCT.pack(MAGIC, VERSION, draw(kind), draw(job), draw(st.one_of(st.integers(0, 70), u8)),
                              draw(st.one_of(st.integers(0, 4), u8)), draw(small), draw(small), draw(small),
                              draw(small), draw(st.one_of(st.integers(0, 400), u16)), draw(s8), draw(s8),
                              draw(st.one_of(st.just(0), u32)), draw(u64), draw(st.one_of(st.integers(0, 7), u8)),
                              draw(s8), draw(st.one_of(st.just(0), u16)))


def datagrams(kind: st.SearchStrategy[int] = u8, job: st.SearchStrategy[int] = u16) -> st.SearchStrategy[bytes]:
    payload = st.one_of(st.binary(max_size=8), st.binary(min_size=4 * LAYOUT.lanes, max_size=4 * LAYOUT.lanes),
                        st.binary(max_size=1600))
    structured = st.builds(lambda h, p: h + p, headers(kind, job), payload)
    return st.one_of(st.binary(max_size=1600), structured)


@FUZZ
@given(data=datagrams())
def test_the_header_decoder_returns_a_header_or_raises_wire_error(data: bytes) -> None:
    try:
        head = Header.decode(data)
    except WireError:
        return
    assert isinstance(head, Header) and len(data) >= HEADER_BYTES


@pytest.mark.parametrize("secret", [False, True], ids=["no-secret", "secret"])
@FUZZ
@given(data=datagrams(kind=st.one_of(st.just(int(Kind.DATA)), u8), job=st.one_of(st.just(JOB), u16)))
def test_the_fallback_takes_drops_or_rejects_random_data(secret: bool, data: bytes) -> None:
    agg = UserspaceAggregator(LAYOUT, job=JOB, expected=0b111, timeout=1.0)
    if secret:
        agg.require_tokens(12345)
        agg.install_tokens([(w, k, 99) for w in range(3) for k in range(8)])
    try:
        out = agg.on_data(data, 0.0)
    except WireError:
        return
    assert out is None or (isinstance(out, bytes) and Header.decode(out).kind == Kind.AGG)


@pytest.fixture
def agents() -> Iterator[dict[bool, EdgeAgent]]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        yield {bool(secret): EdgeAgent(sock, LAYOUT, workers=3, job=JOB, mode="userspace",
                                       secret=SECRET if secret else None) for secret, sock in enumerate(socks)}
    finally:
        for sock in socks:
            sock.close()


@FUZZ
@given(data=datagrams(job=st.one_of(st.just(JOB), u16)), secret=st.booleans())
def test_the_agent_handles_or_rejects_random_datagrams(agents: dict[bool, EdgeAgent], data: bytes,
                                                        secret: bool) -> None:
    agent = agents[secret]
    with contextlib.suppress(WireError):
        agent.core.datagram(data, ("10.0.0.9", 4000), 0.0)
    while (batch := agent.outbox.next(0.0)) is not None:   # answers (HELLO, PULL) would go out; nothing piles up
        agent.outbox.done(batch, 0.0)
    assert len(agent.core.book.open) <= 8 and set(agent.addresses) <= {0, 1, 2}


def test_a_valid_data_datagram_still_goes_through_the_fuzzed_path() -> None:
    """The strategies reach the aggregation itself: a well-formed DATA datagram is aggregated."""
    from netstorm.lan.packets import data_packets

    agg = UserspaceAggregator(LAYOUT, job=JOB, expected=0b1, timeout=1.0)
    row = bytes(data_packets(LAYOUT, job=JOB, worker=0, iteration=1, tensor=1, values=np.ones(7))[0])
    out = agg.on_data(row, 0.0)
    assert out is not None and struct.unpack_from("<B", out, 3)[0] == Kind.AGG
