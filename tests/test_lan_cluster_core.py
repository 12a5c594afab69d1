"""The cluster aggregator's core by plain calls: no sockets, no event loop, a fake clock, the userspace
aggregator as its program.

Loading configures the program and bounds it AHEAD past the first iteration; the group's ACKs, RESULTs and
FAILEDs and the gateway's NACKs raise the horizon (a forged one does not, a service hearing no group bounds
nothing); a gateway's NACK waits a reorder window and then NACKs exactly the members the slot lacks; DATA of
another epoch is answered MOVED once per hold while the service asks for its part until answered; a
deployment the program cannot take fails. And under any order of the members' DATA with a far-future
datagram slipped in anywhere (hypothesis), the far-future one is refused and counted and every chunk the
cluster forwards is the exact sum.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpf.fallback import UserspaceAggregator
from netstorm.errors import LayoutError
from netstorm.lan.clusteractions import (
    AGGREGATE,
    Action,
    Ask,
    Bound,
    Configure,
    Fail,
    InstallTokens,
    ReadSlots,
    RequireTokens,
    Send,
)
from netstorm.lan.clustercore import AHEAD, MOVED_HOLD, REHELLO_S, REORDER_MIN, ClusterCore
from netstorm.lan.deploy import Deployment
from netstorm.lan.errors import StaleDeployment
from netstorm.lan.header import HEADER_BYTES, Flag, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import cluster_nack_packet, control_packet, data_packets, set_epoch
from netstorm.lan.slots import TOKEN_WINDOW, slot_dtype
from netstorm.lan.tokens import LanTokens, Sender

JOB = 6
WORKER = 1
MEMBERS = (2, 3)
CLUSTER = (WORKER, *MEMBERS)
GATEWAY = ("10.0.0.1", 9000)
ADDRESS = {w: (f"10.0.0.{10 + w}", 6000 + w) for w in range(6)}
GROUP = ("239.1.2.3", 9001)
LAYOUT = EdgeLayout.uniform([16 * 7 + 5], scale=10, lanes=16, pool=4)
"""The members' model: 8 chunks through the pool's 4 slots."""
FIRST = 40
RETRANSMIT = 0.01
SECRET = b"cluster-core-secret"


def deployment(**changes: object) -> Deployment:
    fields: dict[str, object] = {"pool": LAYOUT.pool, "lanes": LAYOUT.lanes, "scale": 10, "group": GROUP,
                                 "members": MEMBERS, "retransmit": RETRANSMIT, "first_iteration": FIRST}
    fields.update(changes)
    return Deployment(**fields)  # type: ignore[arg-type]


class Shell:
    """What bpf/cluster.py does with the core's actions, on the userspace aggregator: the program's map writes,
    slot reads handed back, datagrams kept in ``sent``."""

    def __init__(self, *, secret: bytes | None = None, userspace: bool = True, **changes: object) -> None:
        self.tokens = LanTokens(secret, JOB)
        self.core = ClusterCore(worker=WORKER, job=JOB, gateway=GATEWAY, tokens=self.tokens, userspace=userspace)
        part = deployment(**changes)
        self.program = UserspaceAggregator(EdgeLayout.uniform([part.pool * part.lanes], 10, lanes=part.lanes,
                                                              pool=part.pool),
                                           job=JOB, expected=0, timeout=1.0, max_nacks=0, up_worker=WORKER)
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self.bounds: list[int | None] = []
        self.failures: list[Exception] = []
        self.forwarded: list[bytes] = []
        self.apply(self.core.begin(part))

    def apply(self, actions: list[Action] | tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.sent.append((action.datagram, action.to))
            elif isinstance(action, Configure):
                self.program.redeploy(expected=action.expected, epoch=action.epoch)
            elif isinstance(action, RequireTokens):
                self.program.require_tokens(action.agg_token)
            elif isinstance(action, InstallTokens):
                self.program.install_tokens(action.entries)
                self.program.up_tokens.update({k: t for w, k, t in action.entries if w == WORKER})
            elif isinstance(action, Bound):
                self.bounds.append(action.horizon)
                self.program.bound(action.horizon)
            elif isinstance(action, ReadSlots):
                states = self.program.slot_states(np.array([a.slot for a in action.asks], np.int64))
                self.apply(self.core.slots(action.asks, states))
            elif isinstance(action, Fail):
                self.failures.append(action.error)

    def group(self, kind: Kind, iteration: int, *, token: int | None = None, epoch: int = 0, now: float = 0.0) -> None:
        datagram = control_packet(kind, job=JOB, worker=0, iteration=iteration, epoch=epoch,
                                  token=self.tokens.group(iteration) if token is None else token)
        self.apply(self.core.group(datagram, now))

    def data(self, datagram: bytes, address: tuple[str, int], now: float = 0.0) -> None:
        head = Header.decode(datagram)
        for action in self.core.data(head.worker, head.iteration, head.epoch, address, now):
            if action is not AGGREGATE:
                self.apply([action])
                continue
            try:
                out = self.program.on_data(datagram, now)
            except StaleDeployment as exc:
                self.apply(self.core.stale(exc.worker, exc.iteration, address, now))
                continue
            if out is not None:
                self.forwarded.append(out)

    def hellos(self) -> None:
        """Every member and this worker's trainer say HELLO here."""
        for w in CLUSTER:
            hello = control_packet(Kind.HELLO, job=JOB, worker=w, iteration=7 + w,
                                   token=self.tokens.of(Sender.WORKER, w, 7 + w, keep=False))
            self.apply(self.core.datagram(hello, ADDRESS[w], 0.0))

    def take_sent(self) -> list[tuple[Header, bytes, tuple[str, int]]]:
        out = [(Header.decode(d), d, a) for d, a in self.sent]
        self.sent = []
        return out


def contributions(iteration: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(iteration)
    return {w: (rng.standard_normal(LAYOUT.sizes[0]) * 4).astype(np.float32) for w in CLUSTER}


def rows(values: dict[int, np.ndarray], iteration: int, tokens: LanTokens) -> dict[int, np.ndarray]:
    return {w: data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=0, values=v,
                            token=tokens.worker(w, iteration)) for w, v in values.items()}


def exact_lanes(values: dict[int, np.ndarray], chunk: int) -> np.ndarray:
    a, b = LAYOUT.bounds(0, chunk)
    return np.sum([np.rint(v[a:b].astype(np.float64) * 2.0**10).astype(np.int64) for v in values.values()], axis=0)


def test_loading_configures_the_program_and_bounds_it_ahead_of_the_first_iteration() -> None:
    tokens = LanTokens(SECRET, JOB)
    core = ClusterCore(worker=WORKER, job=JOB, gateway=GATEWAY, tokens=tokens, userspace=False)
    actions = core.begin(deployment())
    configure, require, bound_none, install, bound = actions
    assert configure == Configure(0b1110, 0)
    assert require == RequireTokens(1)
    assert bound_none == Bound(None)    # whatever an earlier configuration of the program left
    assert isinstance(install, InstallTokens)
    assert sorted(install.entries) == sorted((w, k, tokens.worker(w, k)) for w in CLUSTER
                                             for k in range(FIRST, FIRST + TOKEN_WINDOW))
    assert bound == Bound(FIRST + AHEAD)
    assert core.next_timer() is None
    # on standby the program expects nobody
    assert ClusterCore(worker=WORKER, job=JOB, gateway=GATEWAY, tokens=tokens, userspace=False).begin(
        deployment(standby=True, members=()))[0] == Configure(0, 0)


def test_the_horizon_rises_with_the_groups_acks_results_failures_and_the_gateways_nacks() -> None:
    shell = Shell(secret=SECRET)
    assert shell.bounds == [None, FIRST + AHEAD]
    shell.group(Kind.ACK, FIRST)            # the gateway receives FIRST: nothing new
    assert shell.bounds[-1] == FIRST + AHEAD and len(shell.bounds) == 2
    shell.group(Kind.RESULT, FIRST)         # FIRST is over: FIRST + 1 comes
    assert shell.bounds[-1] == FIRST + 1 + AHEAD
    for _ in range(50):                     # the rest of a result burst changes nothing
        shell.group(Kind.RESULT, FIRST)
    assert len(shell.bounds) == 3
    shell.group(Kind.FAILED, FIRST + 1)
    assert shell.bounds[-1] == FIRST + 2 + AHEAD
    shell.group(Kind.ACK, FIRST + 3)
    assert shell.bounds[-1] == FIRST + 3 + AHEAD
    # the gateway's NACK for FIRST + 5 says it receives it
    nack = cluster_nack_packet(LAYOUT, 2, job=JOB, iteration=FIRST + 5, token=shell.tokens.gateway(WORKER, FIRST + 5))
    shell.apply(shell.core.datagram(nack, (GATEWAY[0], 9999), 0.0))
    assert shell.bounds[-1] == FIRST + 5 + AHEAD
    # older news lowers nothing; a forged RESULT far ahead raises nothing and is counted
    shell.group(Kind.RESULT, FIRST + 1)
    shell.group(Kind.RESULT, FIRST + 10**6, token=shell.tokens.group(FIRST + 1))
    shell.group(Kind.ACK, FIRST + 10**6, token=0)
    assert shell.bounds[-1] == FIRST + 5 + AHEAD and shell.core.forged == 2
    assert shell.program.horizon == FIRST + 5 + AHEAD
    # and their tokens went in as the window moved: FIRST + 5's window is installed
    assert shell.core.follow(FIRST + 5) == []


def test_the_horizon_wraps_with_the_iterations() -> None:
    shell = Shell(first_iteration=2**32 - 2)
    assert shell.bounds[-1] == 2**32 - 2 + AHEAD
    shell.group(Kind.RESULT, 2**32 - 1)
    assert shell.bounds[-1] == AHEAD         # iteration 2**32 wraps to 0
    shell.group(Kind.RESULT, 2**32 - 3)      # older, across the wrap
    assert shell.bounds[-1] == AHEAD


def test_a_service_that_hears_no_group_bounds_nothing() -> None:
    shell = Shell(group=None)
    shell.group(Kind.RESULT, FIRST + 3)
    assert set(shell.bounds) == {None} and shell.program.horizon is None


def test_a_gateway_nack_waits_a_reorder_window_then_nacks_exactly_the_members_the_slot_lacks() -> None:
    shell = Shell(secret=SECRET)
    shell.hellos()
    values = contributions(FIRST)
    data = rows(values, FIRST, shell.tokens)
    seq = 5
    shell.data(data[WORKER][seq].tobytes(), ADDRESS[WORKER])     # member 2's and 3's datagrams were lost
    now = 1.0
    nack = cluster_nack_packet(LAYOUT, seq, job=JOB, iteration=FIRST, token=shell.tokens.gateway(WORKER, FIRST))
    shell.apply(shell.core.datagram(nack, (GATEWAY[0], 9999), now))
    shell.apply(shell.core.datagram(nack, (GATEWAY[0], 9999), now + 0.001))   # asked again: still one look
    assert shell.core.nacks_in == 2 and shell.take_sent() == []
    due = shell.core.next_timer()
    assert due is not None and due == pytest.approx(now + max(RETRANSMIT, REORDER_MIN))
    shell.apply(shell.core.tick(due - 1e-6))
    assert shell.take_sent() == []
    shell.data(data[2][seq].tobytes(), ADDRESS[2])   # member 2's arrives within the window
    shell.apply(shell.core.tick(due))
    sent = shell.take_sent()
    assert [(h.kind, a) for h, _, a in sent] == [(Kind.NACK, ADDRESS[3])]
    head, datagram, _ = sent[0]
    assert head.iteration == FIRST and head.token == shell.tokens.gateway(3, FIRST)
    assert np.frombuffer(datagram, "<u4", head.count, HEADER_BYTES).tolist() == [seq]
    assert shell.core.nacks_out == 1 and shell.core.next_timer() is None
    # member 3 resends: the slot completes and the exact sum goes on to the gateway
    shell.data(data[3][seq].tobytes(), ADDRESS[3])
    out, = shell.forwarded
    forwarded = Header.decode(out)
    assert (forwarded.kind, forwarded.worker) == (Kind.DATA, WORKER)
    assert forwarded.token == shell.tokens.worker(WORKER, FIRST)
    np.testing.assert_array_equal(np.frombuffer(out, "<i4", forwarded.count, HEADER_BYTES), exact_lanes(values, seq))


def _state(key: tuple[int, int, int], bitmap: int, busy: bool) -> np.void:
    row = np.zeros(1, slot_dtype(56))
    row["iteration"], row["tensor"], row["chunk"] = key
    row["bitmap"], row["busy"] = bitmap, busy
    return row[0]


@pytest.mark.parametrize(("key", "bitmap", "busy", "want"), [
    ((FIRST, 0, 5), 0b0010, True, [2, 3]),         # the slot lacks members 2 and 3
    ((FIRST, 0, 5), 0b1110, False, [WORKER]),      # completed: this worker's duplicate re-emits the aggregate
    ((FIRST, 0, 0), 0, False, list(CLUSTER)),      # nothing ever came
    ((FIRST - 1, 0, 1), 0b0110, True, list(CLUSTER)),   # an older key: every datagram of ours was lost
    ((FIRST + 1, 0, 1), 0b0110, True, []),         # a newer key took the slot over: nobody can help
], ids=["lacking", "completed", "empty", "older", "newer"])
def test_who_a_slot_asks_to_resend(key: tuple[int, int, int], bitmap: int, busy: bool, want: list[int]) -> None:
    core = Shell().core
    assert core.missing(Ask(1, FIRST, 0, 5, 5, 0.0), _state(key, bitmap, busy)) == want


def test_a_forged_or_misaddressed_gateway_nack_is_counted_and_asks_nothing() -> None:
    shell = Shell(secret=SECRET)
    shell.hellos()
    good = shell.tokens.gateway(WORKER, FIRST)
    for token, address in [(0, GATEWAY), (shell.tokens.gateway(2, FIRST), GATEWAY), (good, ADDRESS[2])]:
        nack = cluster_nack_packet(LAYOUT, 1, job=JOB, iteration=FIRST, token=token)
        shell.apply(shell.core.datagram(nack, address, 0.0))
    forged_hello = control_packet(Kind.HELLO, job=JOB, worker=4, iteration=3, token=5)
    shell.apply(shell.core.datagram(forged_hello, ADDRESS[4], 0.0))
    assert shell.core.forged == 4 and shell.core.nacks_in == 0 and shell.core.next_timer() is None
    assert 4 not in shell.core.members and shell.take_sent() == []


def test_data_of_another_epoch_is_answered_moved_once_per_hold_and_the_service_asks_until_answered() -> None:
    shell = Shell(secret=SECRET, userspace=False)
    stale = set_epoch(data_packets(LAYOUT, job=JOB, worker=2, iteration=FIRST, tensor=0,
                                   values=contributions(FIRST)[2], token=shell.tokens.worker(2, FIRST)), 3)
    shell.data(stale[0].tobytes(), ADDRESS[2], now=0.0)
    shell.data(stale[1].tobytes(), ADDRESS[2], now=MOVED_HOLD / 2)      # within the hold: no second MOVED
    sent = shell.take_sent()
    assert [(h.kind, a) for h, _, a in sent] == [(Kind.MOVED, ADDRESS[2]), (Kind.HELLO, GATEWAY)]
    moved, hello = sent[0][0], sent[1][0]
    assert (moved.worker, moved.iteration, moved.epoch, moved.token) == (2, FIRST, 0, shell.tokens.gateway(2, FIRST))
    assert hello.flags & Flag.AGGREGATOR and hello.token == shell.tokens.of(Sender.WORKER, WORKER, hello.iteration,
                                                                            keep=False)
    assert shell.core.moved_sent == 1 and shell.core.rehellos == 1 and shell.program.stats()["rx"] == 0
    # unanswered, the HELLO is said again every REHELLO_S with the same nonce
    assert shell.core.next_timer() == pytest.approx(REHELLO_S)
    shell.apply(shell.core.tick(REHELLO_S))
    again, = shell.take_sent()
    assert again[0].kind == Kind.HELLO and again[0].iteration == hello.iteration
    # a forged answer is ignored; the gateway's is taken: epoch 3, member 4 instead of 3
    part = deployment(epoch=3, members=(2, 4), first_iteration=FIRST + 1)
    for token in (0, shell.tokens.of(Sender.GATEWAY, WORKER, hello.iteration, keep=False)):
        answer = control_packet(Kind.HELLO, job=JOB, worker=WORKER, iteration=hello.iteration, epoch=3,
                                flags=Flag.AGGREGATOR, token=token) + part.encode()
        shell.apply(shell.core.datagram(answer, (GATEWAY[0], 9999), REHELLO_S + 0.01))
        assert shell.core.redeployed == (0 if token == 0 else 1)
    assert shell.core.epoch == 3 and shell.core.next_timer() is None
    assert (shell.program.expected, shell.program.epoch) == (0b10110, 3)
    # the old member's tokens stay (its DATA of the old epoch authenticates and is told MOVED)
    old = data_packets(LAYOUT, job=JOB, worker=3, iteration=FIRST + 1, tensor=0, values=contributions(FIRST)[3],
                       token=shell.tokens.worker(3, FIRST + 1))
    shell.data(old[2].tobytes(), ADDRESS[3], now=1.0)
    assert shell.core.moved_sent == 2 and shell.core.rehellos == 2


def test_a_deployment_the_program_cannot_take_fails() -> None:
    shell = Shell()
    shell.apply(shell.core.redeploy(deployment(pool=8, epoch=1)))
    error, = shell.failures
    assert isinstance(error, LayoutError) and shell.core.epoch == 0


def _run_iteration(shell: Shell, iteration: int, order: list[int], slip: int, ahead: int, *,
                   who: int) -> dict[int, np.ndarray]:
    """Every chunk's DATA from every member in ``order``, chunk after chunk, and a DATA of ``iteration + ahead``
    from ``who`` slipped in before the ``slip``-th datagram."""
    values = contributions(iteration)
    data = rows(values, iteration, shell.tokens)
    far = data_packets(LAYOUT, job=JOB, worker=who, iteration=iteration + ahead, tensor=0,
                       values=contributions(iteration + ahead)[who])
    sequence = [data[w][seq].tobytes() for seq in range(LAYOUT.num_chunks) for w in order]
    sequence.insert(slip % (len(sequence) + 1), far[slip % LAYOUT.num_chunks].tobytes())
    for datagram in sequence:
        shell.data(datagram, ADDRESS[Header.decode(datagram).worker])
    shell.group(Kind.RESULT, iteration)
    return values


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(CLUSTER), slips=st.tuples(st.integers(0, 30), st.integers(0, 30)),
       ahead=st.integers(AHEAD + 2, 2**31 - 1), who=st.sampled_from(CLUSTER))
def test_a_far_future_datagram_is_refused_and_counted_and_every_forwarded_chunk_is_exact(
        order: list[int], slips: tuple[int, int], ahead: int, who: int) -> None:
    shell = Shell()
    for k, slip in enumerate(slips):
        iteration = FIRST + k
        before = len(shell.forwarded)
        values = _run_iteration(shell, iteration, list(order), slip, ahead, who=who)
        forwarded = shell.forwarded[before:]
        assert len(forwarded) == LAYOUT.num_chunks
        for out in forwarded:
            head = Header.decode(out)
            assert head.iteration == iteration
            np.testing.assert_array_equal(np.frombuffer(out, "<i4", head.count, HEADER_BYTES),
                                          exact_lanes(values, head.chunk))
    stats = shell.program.stats()
    assert stats["future"] == len(slips) and stats["busy_evicted"] == 0 and stats["stale"] == 0


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from([Kind.ACK, Kind.RESULT, Kind.FAILED]), st.integers(-3, 12),
                                 st.booleans()), max_size=30))
def test_the_horizon_is_ahead_of_the_newest_genuine_news_in_any_order(events: list[tuple[Kind, int, bool]]) -> None:
    shell = Shell(secret=SECRET)
    newest = FIRST
    for kind, offset, genuine in events:
        iteration = FIRST + offset
        shell.group(kind, iteration, token=None if genuine else shell.tokens.group(iteration) ^ 1)
        if genuine:
            newest = max(newest, iteration + (kind != Kind.ACK))
        assert shell.core.horizon == newest + AHEAD == shell.program.horizon
    rises = [b for b in shell.bounds[1:] if b is not None]
    assert rises == shell.bounds[1:] and rises == sorted(set(rises))   # each Bound only ever rose
