"""The LAN tier's round wires of a compressed job (no network): which lanes travel in each round, the
schedule every party derives alike, and the GIA size read from the summed votes."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.compression.options import SCALE, VALUES, VOTES, CompressionOptions
from netstorm.compression.session import Rounds
from netstorm.lan.errors import WireError
from netstorm.lan.introunds import GatewayRounds, Kind, RoundPlan, gia_size
from netstorm.lan.resultwire import Format

MODEL = {"w": np.zeros((30, 20), np.float32), "b": np.zeros(11, np.float32)}


def plan_for(options: CompressionOptions, contributors: int = 4) -> tuple[RoundPlan, dict[str, np.ndarray]]:
    registered = Rounds(options, MODEL).registered(MODEL)
    return RoundPlan(registered, options, lanes=100, pool=2, scale=16, contributors=contributors), registered


def test_wires_carry_votes_whole_and_values_up_to_the_gia() -> None:
    plan, _ = plan_for(CompressionOptions("fediac", k=0.1, bits=10, votes=2))
    names = list(plan.names)
    votes = plan.first()
    assert votes.kind is Kind.VOTES and votes.integer
    assert [names[t] for t in votes.tensors] == sorted([SCALE, VOTES])
    assert votes.layout.sizes == (768, 611) and votes.layout.scales == (0, 0)
    counts = np.zeros(611)
    counts[[3, 50, 400]] = [2, 3, 4]
    counts[[7, 9]] = 1   # below the threshold a = 2
    scale = np.zeros(768)
    scale[[100, 130]] = [3, 1]
    returned = plan.returned(votes, [scale, counts])
    # the LAN gets the GIA and the occupied scale buckets, not the counts
    assert np.flatnonzero(returned[1]).tolist() == [3, 50, 400] and set(np.unique(returned[1])) == {0, 1}
    assert np.flatnonzero(returned[0]).tolist() == [100, 130] and returned[0].max() == 1
    assert votes.result.formats == (Format.BITMAP, Format.BITMAP)
    assert votes.result.layout.sizes == (96, 77) and votes.result.layout.lanes == 400   # 8 elements a byte lane
    values = plan.following(votes, returned)
    assert values.kind is Kind.VALUES and values.gia == 3 == gia_size(counts, 2)
    assert values.result.formats == (Format.INTEGER,) and values.result.layout.lanes == 100
    assert [names[t] for t in values.tensors] == [VALUES] and values.layout.sizes == (3,)
    assert values.layout.num_chunks == 1 and values.layout.num_slots == 1   # the pool cycles over the GIA
    assert plan.following(values, [np.zeros(3)]).kind is Kind.VOTES
    empty = plan.following(votes, plan.returned(votes, [np.zeros(768), np.zeros(611)]))
    assert empty.gia == 0 and empty.layout.sizes == (1,)   # an empty GIA still takes one lane of zeros


def test_derived_bits_start_with_a_dense_round_of_the_model_at_its_scale() -> None:
    plan, _ = plan_for(CompressionOptions("fediac", k=0.1, bits=0))
    dense = plan.first()
    assert dense.kind is Kind.DENSE and not dense.integer
    assert dense.layout.sizes == (11, 600) and dense.layout.scales == (16, 16)
    assert plan.following(dense, [np.zeros(11), np.zeros(600)]).kind is Kind.VOTES


def test_topk_values_travel_at_the_model_scale() -> None:
    plan, _ = plan_for(CompressionOptions("topk", k=5))
    votes = plan.first()
    assert votes.layout.sizes == (611,)   # top-k sends no scale one-hot
    counts = np.zeros(611)
    counts[:9] = [1, 2, 3, 4, 1, 1, 1, 2, 1]   # the union: threshold 1
    values = plan.following(votes, plan.returned(votes, [counts]))
    assert values.gia == 9 and not values.integer and values.layout.scales == (16,)
    assert values.result.formats == (Format.FLOAT,)


def test_lanes_round_trip_and_nothing_past_a_wire_is_dropped_silently() -> None:
    options = CompressionOptions("fediac", k=0.2, bits=10, votes=1)
    plan, registered = plan_for(options, contributors=2)
    rounds = Rounds(options, MODEL, seed=1)
    rounds.registered(MODEL)
    rounds.start(2, 0)
    rng = np.random.default_rng(0)
    grads = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in MODEL.items()}
    steps = rounds.iteration(grads)
    push = next(steps)
    wire = plan.first()
    lanes = plan.lanes_of(wire, push)
    full = plan.shaped(plan.expand(wire, lanes), registered)
    for name in registered:
        assert np.array_equal(full[name].reshape(-1), np.asarray(push[name]).reshape(-1).astype(full[name].dtype))
    assert [x.size for x in plan.restrict(wire, plan.expand(wire, lanes))] == list(wire.extents)
    # alone, every vote of this contributor agrees
    values = plan.following(wire, plan.returned(wire, [lanes[0], lanes[1]]))
    push = steps.send(full)
    plan.lanes_of(values, push)
    bad = dict(push)
    bad[VALUES] = np.asarray(push[VALUES]).copy()
    bad[VALUES][values.gia + 1] = 1
    with pytest.raises(WireError, match="nonzero past"):
        plan.lanes_of(values, bad)
    wide = dict(push)
    wide[VALUES] = np.asarray(push[VALUES]).astype(np.int64)
    wide[VALUES][0] = 2**24 + 1
    with pytest.raises(WireError, match="not exact"):
        plan.lanes_of(values, wide)


def test_the_gateway_plans_the_next_wire_from_the_result_it_releases() -> None:
    plan, registered = plan_for(CompressionOptions("fediac", k=0.1, bits=10, votes=2))
    gateway = GatewayRounds(plan, 10)
    names = list(plan.names)
    result = [np.zeros(registered[n].size, np.float32) for n in names]
    result[names.index(VOTES)][[1, 2, 5]] = [2, 2, 1]
    back, following = gateway.released(10, result)
    assert [b.size for b in back] == [768, 611] and np.flatnonzero(back[1]).tolist() == [1, 2]
    assert gateway.wire_of(11) is following and following.gia == 2
    lan = gateway.contribution(11, [np.array([5, -3], np.float32)])
    assert lan[names.index(VALUES)][:2].tolist() == [5, -3] and not lan[names.index(VALUES)][2:].any()
    with pytest.raises(WireError, match="no planned wire"):
        gateway.wire_of(13)


def test_after_a_failed_iteration_the_gateway_and_a_worker_restart_the_rounds_alike() -> None:
    plan, registered = plan_for(CompressionOptions("fediac", k=0.1, bits=10, votes=2))
    gateway = GatewayRounds(plan, 20)
    names = list(plan.names)
    result = [np.zeros(registered[n].size, np.float32) for n in names]
    result[names.index(VOTES)][[1, 2, 5]] = [2, 2, 1]
    _, values = gateway.released(20, result)
    assert values.kind is Kind.VALUES
    following = gateway.failed(21)   # the values round failed: the next iteration votes again
    assert following is not None and following.kind is Kind.VOTES and gateway.wire_of(22) is following
    assert plan.restart(values) == following
    assert gateway.failed(21) is None and gateway.failed(40) is None   # reported twice; never planned
    again = gateway.failed(22)   # the votes round failed: votes again
    assert again is not None and again.kind is Kind.VOTES
    dense_plan, _ = plan_for(CompressionOptions("fediac", k=0.1, bits=0, votes=2))
    first = dense_plan.first()
    assert first.kind is Kind.DENSE and dense_plan.restart(first).kind is Kind.DENSE   # b is not derived yet


def test_an_integer_push_goes_on_the_narrowest_lane_that_holds_it_exactly() -> None:
    from netstorm.lan.header import Precision
    from netstorm.lan.precision import decode_lanes, encode_lanes, int8_scales, integer_precision

    def exact(values: np.ndarray, precision: Precision) -> bool:
        matrix = values.astype(np.float64)[None, :]
        wscales = int8_scales(matrix) if precision == Precision.INT8 else np.zeros(1, np.int64)
        return bool(np.array_equal(decode_lanes(encode_lanes(matrix, precision, wscales), precision, wscales)[0],
                                   matrix[0]))

    for peak, want in [(1, Precision.INT8), (127, Precision.INT8), (128, Precision.FP16), (2048, Precision.FP16),
                       (2049, Precision.FIXED32), (2**24, Precision.FIXED32)]:
        values = np.arange(-peak, peak + 1, max(1, peak // 500), dtype=np.float32)
        values[-1] = peak
        got = integer_precision([np.zeros(3, np.float32), values], Precision.INT8)
        assert got is want, (peak, got)
        # the chosen lane carries every integer exactly, and the narrower one would not have
        assert got is Precision.FIXED32 or exact(values, got)
        if got is not Precision.INT8:
            assert not exact(values, Precision.INT8 if got is Precision.FP16 else Precision.FP16)
    assert integer_precision([np.full(4, 9e6, np.float32)], Precision.FIXED32) is Precision.FIXED32


def test_the_gateway_role_plans_the_restart_before_it_tells_the_workers_and_only_once() -> None:
    from bpf.gateway import EdgeOptions, GatewayRole

    calls: list[tuple[str, int, Kind | None]] = []

    class Agent:   # what the role drives of the EdgeAgent
        def __init__(self) -> None:
            self.failed: dict[int, str] = {}

        def plan(self, iteration: int, layout: object, *, integer: bool = False, back: object = None) -> None:
            calls.append(("plan", iteration, gateway.wire_of(iteration).kind))

        def fail(self, iteration: int) -> None:
            calls.append(("fail", iteration, None))
            self.failed[iteration] = ""

    plan, registered = plan_for(CompressionOptions("fediac", k=0.1, bits=10, votes=2))
    role = GatewayRole(EdgeOptions(workers=2, listen=("127.0.0.1", 0), mode="userspace"), iteration_timeout=1.0)
    gateway = GatewayRounds(plan, 6)
    role.agent, role.rounds, role.init_iteration = Agent(), gateway, 5   # type: ignore[assignment]
    from netstorm.layout import Layout, TensorSpec

    role.compressed(Layout.build([TensorSpec.of(n, a) for n, a in registered.items()], 65536), plan.options)
    names = list(plan.names)
    result = [np.zeros(registered[n].size, np.float32) for n in names]
    result[names.index(VOTES)][[1, 2]] = [2, 2]
    role.released(6, plan.expand(gateway.wire_of(6), plan.restrict(gateway.wire_of(6), result)), 3)
    calls.clear()
    role.failed(6)   # its result went back already: nothing to undo
    role.failed(7)   # the values round failed: votes next, planned, then the workers are told
    role.failed(7)   # reported again
    role.failed(4)   # before the LAN tier's first summed iteration
    assert calls == [("plan", 8, Kind.VOTES), ("fail", 7, None)]


@pytest.mark.parametrize("reuse", [2, 3])
def test_a_reused_gia_sends_values_and_the_scale_on_the_wires_the_rounds_push(reuse: int) -> None:
    """``fediac_gia_reuse``: the wires follow the Rounds core of every contributor (votes and values, then
    reuse - 1 iterations of values and the scale one-hot at the kept GIA, then a vote again): nothing a push
    holds falls outside its wire, and the GIA stays the votes round's."""
    options = CompressionOptions("fediac", k=0.2, bits=10, votes=1, gia_reuse=reuse)
    plan, registered = plan_for(options, contributors=1)
    names = list(plan.names)
    rounds = Rounds(options, MODEL, seed=4)
    rounds.registered(MODEL)
    rounds.start(1, 0, applied=plan.threshold)   # the LAN returns the GIA: read as the roots'
    rng = np.random.default_rng(2)
    wire = plan.first()
    kinds = []
    gia = -1
    for _ in range(2 * reuse):
        grads = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in MODEL.items()}
        steps = rounds.iteration(grads)
        push = next(steps)
        while True:
            current = wire
            kinds.append(current.kind)
            lanes = plan.lanes_of(current, push)   # WireError if the rounds pushed past the wire
            returned = plan.returned(current, lanes)
            back = current.result
            got = back.decode([back.encode(t, r)[1].astype(np.float32) for t, r in enumerate(returned)])
            assert all(np.array_equal(a, b) for a, b in zip(got, returned, strict=True))
            wire = plan.following(current, got)
            if current.kind is Kind.VOTES:
                gia = wire.gia
            elif current.kind is Kind.REUSED:
                assert current.gia == gia and {names[t] for t in current.tensors} == {VALUES, SCALE}
                assert back.formats == tuple(Format.BITMAP if names[t] == SCALE else Format.INTEGER
                                             for t in current.tensors)
            try:
                push = steps.send(plan.shaped(plan.expand(current, got), registered))
            except StopIteration:
                break
        assert rounds.last.reused == (current.kind is Kind.REUSED) and rounds.last.gia == gia
    cycle = [Kind.VOTES, Kind.VALUES] + [Kind.REUSED] * (reuse - 1)
    assert kinds == cycle * 2


def test_the_gateways_rounds_of_a_registered_layout_are_the_plan_every_worker_derives() -> None:
    """``GatewayRounds.of_layout``: the node's registered layout gives the same wires as the registered
    tensors do at a worker, from the first summed iteration on, with at least one contributor."""
    from netstorm.layout import Layout, TensorSpec

    options = CompressionOptions("fediac", k=0.1, bits=10, votes=1)
    plan, registered = plan_for(options, contributors=1)
    layout = Layout.build([TensorSpec.of(n, a) for n, a in registered.items()], 65536)
    rounds = GatewayRounds.of_layout(layout, options, lanes=100, pool=2, scale=16, contributors=0, first_iteration=6)
    want, got = plan.first(), rounds.wire_of(6)
    assert (got.kind, got.tensors, got.extents, got.layout.sizes) == (want.kind, want.tensors, want.extents,
                                                                     want.layout.sizes)
    assert rounds.plan.threshold == plan.threshold and rounds.plan.names == plan.names
    with pytest.raises(WireError):
        rounds.wire_of(5)
