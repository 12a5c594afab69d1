"""The LAN gateway's core (netstorm/lan/gatewaycore.py) with the userspace aggregator, by plain calls and a
fake clock: DATA in, sums, ACKs and results out. A datagram for an iteration past the window's horizon (the
far-future datagram: k+2 while k is summed) is refused and counted, and every window stays exact and on time."""

from __future__ import annotations

import numpy as np

from bpf.fallback import UserspaceAggregator
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.header import Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import data_packets
from netstorm.lan.tokens import LanTokens
from tests.lan_gateway import hello, sent

LAYOUT = EdgeLayout.uniform([700, 9], scale=10, lanes=64)
JOB = 5
WORKERS = 3
SECRET = b"the job secret, 32 bytes or more"


def gateway(secret: bytes | None) -> GatewayCore:
    fallback = UserspaceAggregator(LAYOUT, job=JOB, expected=(1 << WORKERS) - 1, timeout=0.05)
    core = GatewayCore(LAYOUT, fallback, workers=WORKERS, job=JOB, userspace=True, port=9000, secret=secret)
    for w in range(WORKERS):
        hello(core, w, ("10.0.0.2", 6000 + w), secret=secret)
    sent(core)
    return core


def push(core: GatewayCore, iteration: int, values: list[list[np.ndarray]], now: float,
         secret: bytes | None, workers: range = range(WORKERS)) -> None:
    """Every DATA datagram of ``workers`` for ``iteration``, in order, then what the wake-up gathered leaves."""
    tokens = LanTokens(secret, JOB)
    for w in workers:
        for t, v in enumerate(values[w]):
            token = tokens.worker(w, iteration) if tokens.enabled else 0
            for row in data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=t, values=v, token=token):
                core.datagram(bytes(row), ("10.0.0.2", 6000 + w), now)
    core.flush(now)


def exact(values: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [(np.sum([np.rint(w[t].astype(np.float64) * 2.0**10) for w in values], axis=0) * 2.0**-10)
            .astype(np.float32) for t in range(len(LAYOUT.sizes))]


def test_a_datagram_two_iterations_ahead_is_refused_and_every_window_stays_exact() -> None:
    for secret in (None, SECRET):
        core = gateway(secret)
        rng = np.random.default_rng(2)
        first = 40
        core.expect(first)
        assert core.window.horizon == first
        tokens = LanTokens(secret, JOB)
        # worker 1, two iterations ahead, with its own (installed) token and values that would show anywhere
        far = data_packets(LAYOUT, job=JOB, worker=1, iteration=first + 2, tensor=0, values=np.full(700, 1000.0),
                           token=tokens.worker(1, first + 2) if tokens.enabled else 0)[0]
        core.datagram(bytes(far), ("10.0.0.2", 6001), 0.0)
        assert core.aggregator.stats()["future"] == 1
        now = 0.0
        for k in range(first, first + 3):
            values = [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes] for _ in range(WORKERS)]
            now += 0.01
            push(core, k, values, now, secret)
            sums = core.book.sums(k)
            assert sums.done, (secret, k, sums.describe_missing())   # no stall: every chunk in, at once
            for got, want in zip(sums.result(), exact(values), strict=True):
                np.testing.assert_array_equal(got, want)
            acks = [Header.decode(d) for d, _ in sent(core)]
            assert {h.kind for h in acks} == {Kind.ACK} and {h.iteration for h in acks} == {k}
            core.collected(k, sums)
            assert core.send_results(k, sums.result(), total=WORKERS, unicast=False) == []
            assert core.window.horizon == k + 1
            results = [Header.decode(d) for d, _ in sent(core)]
            assert {h.kind for h in results} == {Kind.RESULT} and len(results) == WORKERS * LAYOUT.num_chunks
        assert core.aggregator.stats()["future"] == 1


def test_the_horizon_moves_when_the_iteration_completes_or_fails_not_before() -> None:
    core = gateway(None)
    core.expect(7)
    values = [[np.ones(s, np.float32) for s in LAYOUT.sizes] for _ in range(WORKERS)]
    push(core, 7, values, 0.0, None, range(2))   # two of three workers: incomplete
    assert not core.book.sums(7).done and core.window.horizon == 7
    push(core, 8, values, 0.0, None)       # the next iteration's DATA is refused while 7 is being summed
    assert core.aggregator.stats()["future"] == WORKERS * LAYOUT.num_chunks
    push(core, 7, values, 0.0, None, range(2, 3))
    assert core.book.sums(7).done and core.window.horizon == 8   # summed: the workers may send 8 at once
    core.fail(8, "the WAN step failed")
    assert core.window.horizon == 9
    assert [Header.decode(d).kind for d, _ in sent(core)].count(Kind.FAILED) == WORKERS
