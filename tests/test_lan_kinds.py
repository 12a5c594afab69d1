"""The registry of LAN datagram kinds (netstorm/lan/kinds.py): today's wire numbers, and every list that
follows from it (the C defines, the decoders' payload rules, the gateway core's dispatch and token checks, the
worker's forged-token rule) agreeing with every registered kind."""

from __future__ import annotations

import re

import numpy as np
import pytest

from netstorm.lan import gatewaycore, sendercore
from netstorm.lan.batch import valid_headers
from netstorm.lan.downlink import DownlinkReport, report_packet
from netstorm.lan.errors import WireError
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.gatewayrequests import WorkerRequests
from netstorm.lan.header import FIELDS, HEADER_BYTES, HEADER_DTYPE, Header, c_definitions
from netstorm.lan.kinds import CHECKED_KINDS, GATEWAY_TOKENED, LOADER_KINDS, Kind, Party, Payload, Token
from netstorm.lan.packets import control_packet
from netstorm.lan.tokens import LanTokens, Sender
from tests.lan_gateway import sent
from tests.test_lan_gateway_core import JOB, LAYOUT, SECRET, WORKERS, gateway, push

WIRE_NUMBERS = {"DATA": 1, "AGG": 2, "NACK": 3, "RESULT": 4, "PULL": 5, "HELLO": 6, "ACK": 7, "QUERY": 8,
                "REPORT": 9, "FAILED": 10, "MOVED": 11}
"""The kinds' numbers as version 7 of the wire has them: a peer reads these, so they never change."""


def test_the_wire_numbers_are_unchanged() -> None:
    assert {k.name: int(k) for k in Kind} == WIRE_NUMBERS
    assert Kind(6) is Kind.HELLO and Kind.HELLO.value == 6


def test_every_kind_has_its_c_define_and_only_registered_or_reserved_kinds_do() -> None:
    text = c_definitions()
    defined = dict(re.findall(r"#define NS_KIND_(\w+) (\d+)", text))
    assert {name: int(n) for name, n in defined.items()} == {k.name: int(k) for k in Kind} | LOADER_KINDS
    assert not set(LOADER_KINDS.values()) & set(WIRE_NUMBERS.values())
    kind_field = next(f for f in FIELDS if f.name == "kind")
    assert all(k.name in kind_field.meaning for k in Kind)


def _datagram(kind: Kind, payload: int) -> bytes:
    return Header(kind, JOB, 0, 1, 0, 0, 0, 0, 0).encode() + bytes(payload)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_both_decoders_take_the_payload_the_registry_gives_each_kind(kind: Kind) -> None:
    """The largest payload a kind may carry passes ``Header.decode`` and ``valid_headers``; one byte more
    fails both (a kind with lanes: one more lane than the wire allows, at count 0 the empty payload)."""
    spec = kind.spec
    if spec.payload is Payload.LANES:
        ok, too_long = 0, 4 * 1024 + 4
    elif spec.payload is Payload.BYTES:
        assert spec.max_payload > 0
        ok, too_long = spec.max_payload, spec.max_payload + 1
    else:
        ok, too_long = 0, 1
    for size, accepted in ((ok, True), (too_long, False)):
        data = _datagram(kind, size)
        if accepted:
            assert Header.decode(data).kind is kind
        else:
            with pytest.raises(WireError):
                Header.decode(data)
        heads = np.frombuffer(data[:HEADER_BYTES], HEADER_DTYPE)
        assert bool(valid_headers(heads, np.array([len(data)]))[0]) is accepted, (kind.name, size)


def test_every_kind_the_gateway_handles_is_dispatched_and_the_rest_refused() -> None:
    raw, requests = gatewaycore._RAW, gatewaycore._REQUESTS
    for kind in Kind:
        name = kind.spec.gateway
        if name is None:
            assert int(kind) not in raw and int(kind) not in requests
            assert Party.GATEWAY not in kind.spec.handlers or kind is Kind.HELLO
            continue
        owner = WorkerRequests if kind in CHECKED_KINDS else GatewayCore
        assert (requests if kind in CHECKED_KINDS else raw)[int(kind)] is getattr(owner, name)
    # a worker's request: the gateway answers it, so it is a checked kind with a handler
    asked = {k for k in Kind if k.spec.senders == {Party.WORKER} and Party.GATEWAY in k.spec.handlers}
    assert asked == {Kind.PULL, Kind.QUERY, Kind.REPORT} and asked < CHECKED_KINDS
    assert all(k.spec.token is Token.WORKER for k in CHECKED_KINDS)
    core = gateway(None)
    for kind in Kind:
        if kind.spec.gateway is None:
            with pytest.raises(WireError, match=f"unexpected {kind.name}"):
                core.datagram(_datagram(kind, 0), ("10.0.0.2", 6000), 0.0)


def test_every_checked_kind_needs_the_workers_token_and_a_forgery_is_counted() -> None:
    """With a secret, each worker's request about an iteration it has an answer for is refused and counted
    with another worker's token, and answered with its own."""
    core = gateway(SECRET)
    tokens = LanTokens(SECRET, JOB)
    rng = np.random.default_rng(3)
    core.expect(40)
    push(core, 40, [[rng.normal(size=s).astype(np.float32) for s in LAYOUT.sizes] for _ in range(WORKERS)], 0.0,
         SECRET)
    core.collected(40, core.book.open[40])
    core.fail(41)
    sent(core)
    report = DownlinkReport(nbytes=100, span_ns=1000)

    def request(kind: Kind, token: int) -> bytes:
        if kind is Kind.REPORT:
            return report_packet(report, job=JOB, worker=1, iteration=40, token=token)
        iteration = 9 if kind is Kind.HELLO else 41       # a HELLO's nonce; PULL and QUERY of a failed one
        return control_packet(kind, job=JOB, worker=1, iteration=iteration, token=token)

    for kind in sorted(CHECKED_KINDS):
        iteration = int(Header.decode(request(kind, 0)).iteration)
        own = tokens.of(Sender.WORKER, 1, iteration, keep=False)
        forged = core.roster.forged
        with pytest.raises(WireError, match="wrong token"):
            core.datagram(request(kind, tokens.of(Sender.WORKER, 2, iteration, keep=False)), ("10.0.0.2", 6001), 0.0)
        assert core.roster.forged == forged + 1
        core.datagram(request(kind, own), ("10.0.0.2", 6001), 0.0)
        assert core.roster.forged == forged + 1
    answers = {Header.decode(data).kind for data, _ in sent(core)}
    assert {Kind.HELLO, Kind.FAILED} <= answers
    assert core.downlinks.on_report(1, 40, report) is False      # the REPORT was taken already


def test_the_worker_drops_exactly_the_gateway_tokened_kinds_without_the_token() -> None:
    assert {k for k in Kind if sendercore._GATEWAY_TOKENED[int(k)]} == GATEWAY_TOKENED
    assert not sendercore._GATEWAY_TOKENED[[c for c in range(256) if c not in {int(k) for k in Kind}]].any()
    assert {Kind.NACK, Kind.RESULT, Kind.ACK, Kind.FAILED, Kind.MOVED} == GATEWAY_TOKENED
    assert all(Party.WORKER in k.spec.handlers for k in GATEWAY_TOKENED)
