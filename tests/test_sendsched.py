"""PathScheduler follows the paper's Fig. 7 rule, checked by hand and against a direct restatement; with a
view of the links, it offloads only from a lagging primary, onto the path that delivers first."""

from __future__ import annotations

import random

import pytest

from netstorm.sendsched import LinkView, PathScheduler

PRIMARY = (1, 2)
AUX = [(1, 3, 2), (1, 4, 5, 2)]
MB = 1_000_000
PLANNED = {(1, 2): 4 * MB, (1, 3): 4 * MB, (3, 2): 4 * MB, (1, 4): 4 * MB, (4, 5): 4 * MB, (5, 2): 4 * MB}


def test_primary_until_more_than_busy_bound_then_fastest_aux_then_primary():
    s = PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=True)
    chosen = [s.choose() for _ in range(7)]
    # 0, 1, 2 in flight on the primary -> primary (3 in flight is more than the bound of 2);
    # then each auxiliary path once, fastest first; then every path is busy -> primary.
    assert chosen == [PRIMARY, PRIMARY, PRIMARY, AUX[0], AUX[1], PRIMARY, PRIMARY]
    assert s.in_flight == {PRIMARY: 5, AUX[0]: 1, AUX[1]: 1}


def _lagging(**changes: object) -> PathScheduler:
    args: dict = {"busy_bound": 0, "aux_queue_length": 1, "enabled": True, "planned_bps": PLANNED, "slowdown": 0.3}
    args.update(changes)
    return PathScheduler(PRIMARY, AUX, **args)


def test_a_primary_at_its_planned_rate_keeps_its_chunks_however_busy() -> None:
    s = _lagging()
    view = {2: LinkView(50 * MB, 3.0 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    # 3 MB/s is 25 % below the plan's 4 MB/s: within the 30 % the plan may be off.
    assert [s.choose(view.__getitem__, MB) for _ in range(5)] == [PRIMARY] * 5


def test_a_lagging_primary_offloads_onto_the_path_that_delivers_first() -> None:
    s = _lagging(aux_queue_length=2)
    view = {2: LinkView(8 * MB, 2 * MB), 3: LinkView(6 * MB, 4 * MB), 4: LinkView(0, 4 * MB)}
    assert s.choose(view.__getitem__, MB) == PRIMARY, "nothing in flight on the primary yet"
    # Primary: (8 + 1) MB at 2 MB/s = 4.5 s. Via 3: (6 + 1) / 4 + 1 / 4 = 2.0 s.
    # Via 4, 5: 1 / 4 + 1 / 4 + 1 / 4 = 0.75 s, the earliest though the slowest by the plan.
    assert s.choose(view.__getitem__, MB) == AUX[1]
    assert s.choose(view.__getitem__, MB) == AUX[1]
    assert s.choose(view.__getitem__, MB) == AUX[0], "the other path is full"
    view[3] = LinkView(20 * MB, 4 * MB)  # via 3 now takes 5.5 s, later than the primary's 4.5 s
    assert s.choose(view.__getitem__, MB) == PRIMARY
    assert s.in_flight == {PRIMARY: 2, AUX[0]: 1, AUX[1]: 2}


def test_an_unmeasured_primary_or_an_unplanned_link_keeps_the_chunk() -> None:
    view = {2: LinkView(8 * MB, None), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    s = _lagging()
    assert {s.choose(view.__getitem__, MB) for _ in range(3)} == {PRIMARY}, "no rate measured yet"
    s = _lagging(planned_bps={k: v for k, v in PLANNED.items() if k != (1, 2)})
    view[2] = LinkView(8 * MB, 0.5 * MB)
    assert {s.choose(view.__getitem__, MB) for _ in range(3)} == {PRIMARY}, "no planned rate to lag behind"


def test_a_path_through_a_link_without_a_planned_rate_or_a_dead_first_hop_is_never_chosen() -> None:
    s = _lagging(planned_bps={k: v for k, v in PLANNED.items() if k != (3, 2)})
    view = {2: LinkView(8 * MB, 0.5 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 0.0)}
    assert [s.choose(view.__getitem__, MB) for _ in range(3)] == [PRIMARY] * 3


def test_an_unmeasured_first_hop_is_judged_at_its_planned_rate() -> None:
    s = _lagging()
    view = {2: LinkView(8 * MB, 2 * MB), 3: LinkView(0, None), 4: LinkView(0, 1 * MB)}
    s.choose(view.__getitem__, MB)
    # Via 3: 1 / 4 (planned) + 1 / 4 = 0.5 s; via 4, 5: 1 / 1 + 0.5 = 1.5 s.
    assert s.choose(view.__getitem__, MB) == AUX[0]


def test_slowdown_zero_offloads_whenever_the_primary_is_busy() -> None:
    s = _lagging(slowdown=0.0)
    view = {2: LinkView(8 * MB, 4 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    assert [s.choose(view.__getitem__, MB) for _ in range(3)] == [PRIMARY, AUX[0], AUX[1]]


def test_done_frees_the_auxiliary_slot():
    s = PathScheduler(PRIMARY, AUX, busy_bound=0, aux_queue_length=2, enabled=True)
    assert s.choose() == PRIMARY
    assert [s.choose() for _ in range(4)] == [AUX[0], AUX[0], AUX[1], AUX[1]]
    s.done(AUX[1])
    assert s.choose() == AUX[1]
    s.done(AUX[0])
    assert s.choose() == AUX[0]
    s.done(PRIMARY)
    assert s.choose() == PRIMARY


def test_disabled_always_uses_the_primary():
    s = PathScheduler(PRIMARY, AUX, busy_bound=0, aux_queue_length=5, enabled=False)
    assert {s.choose() for _ in range(20)} == {PRIMARY}


def test_no_auxiliary_paths():
    s = PathScheduler(PRIMARY, [], busy_bound=1, aux_queue_length=1, enabled=True)
    assert {s.choose() for _ in range(5)} == {PRIMARY}


def test_duplicate_and_primary_entries_in_aux_are_ignored():
    s = PathScheduler(PRIMARY, [PRIMARY, AUX[0], AUX[0]], busy_bound=0, aux_queue_length=1, enabled=True)
    assert s.aux == (AUX[0],)


@pytest.mark.parametrize("seed", range(10))
def test_matches_the_rule_under_random_completions(seed):
    rng = random.Random(seed)
    bound, qlen = rng.randint(0, 3), rng.randint(1, 3)
    s = PathScheduler(PRIMARY, AUX, busy_bound=bound, aux_queue_length=qlen, enabled=True)
    model: dict[tuple[int, ...], int] = {PRIMARY: 0, AUX[0]: 0, AUX[1]: 0}
    for _ in range(300):
        if rng.random() < 0.55:
            fallback = next((p for p in AUX if model[p] < qlen), PRIMARY)
            expect = PRIMARY if model[PRIMARY] <= bound else fallback
            assert s.choose() == expect
            model[expect] += 1
        else:
            busy = [p for p, n in model.items() if n > 0]
            if busy:
                p = rng.choice(busy)
                s.done(p)
                model[p] -= 1
        assert s.in_flight == model


def test_done_on_an_unknown_or_idle_path_is_an_error():
    s = PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=True)
    with pytest.raises(ValueError, match="not one of"):
        s.done((1, 9, 2))
    with pytest.raises(ValueError, match="no chunk in flight"):
        s.done(AUX[0])
    assert s.choose() == PRIMARY  # state untouched


@pytest.mark.parametrize(("primary", "aux"), [((1,), []), ((1, 1), []), (PRIMARY, [(1, 3, 4)]),
                                              (PRIMARY, [(3, 1, 2)]), (PRIMARY, [(1, 3, 1, 2)])])
def test_rejects_malformed_paths(primary, aux):
    with pytest.raises(ValueError):
        PathScheduler(primary, aux, busy_bound=2, aux_queue_length=1, enabled=True)


def test_rejects_a_slowdown_outside_zero_to_one() -> None:
    for slowdown in (-0.1, 1.0):
        with pytest.raises(ValueError, match="slowdown"):
            PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=True, slowdown=slowdown)


def test_a_queued_chunk_moves_to_an_idle_first_hop_only_while_the_primary_lags() -> None:
    s = _lagging(busy_bound=10, aux_queue_length=1, reroute_below=0.5)
    # Queued while the primary kept its plan: every chunk on the primary.
    fine = {2: LinkView(0, 4 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    assert [s.choose(fine.__getitem__, MB) for _ in range(6)] == [PRIMARY] * 6
    assert s.reroute(fine.__getitem__, MB, 3) is None, "the primary keeps its plan"
    # 40 % below the plan: lagging by aux_slowdown's 30 %, not below reroute_below's half.
    off = {**fine, 2: LinkView(6 * MB, 2.4 * MB)}
    assert s.lagging(off[2]) and s.reroute(off.__getitem__, MB, 3) is None
    # The link slowed to 1 MB/s with 6 MB waiting: the last chunk leaves in 6 s. Via 3: 1 s + 0.25 s.
    slow = {2: LinkView(6 * MB, 1 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    assert s.reroute(slow.__getitem__, MB, 3) == AUX[0]
    assert s.in_flight == {PRIMARY: 5, AUX[0]: 1, AUX[1]: 0}
    assert s.reroute(slow.__getitem__, MB, 3) is None, "the path via 3 has its one chunk in flight"
    assert s.reroute(slow.__getitem__, MB, 5) is None, "no auxiliary path starts at 5"
    assert s.reroute(slow.__getitem__, MB, 4) == AUX[1]
    s.done(AUX[0])
    # Via 3 is busy now (20 MB waiting: 5.25 s) but still before the primary's 6 s.
    busy = {**slow, 3: LinkView(20 * MB, 4 * MB)}
    assert s.reroute(busy.__getitem__, MB, 3) == AUX[0]
    s.done(AUX[0])
    late = {**slow, 3: LinkView(24 * MB, 4 * MB)}  # 6.25 s: the primary is sooner
    assert s.reroute(late.__getitem__, MB, 3) is None
    assert s.in_flight == {PRIMARY: 3, AUX[0]: 0, AUX[1]: 1}


def test_reroute_follows_the_paper_rule_and_the_switches() -> None:
    slow = {2: LinkView(6 * MB, 1 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    for s in (_lagging(slowdown=0.0, reroute_below=0.5), _lagging(enabled=False, reroute_below=0.5),
              _lagging(reroute_below=0.0)):
        s.choose(slow.__getitem__, MB)
        assert s.reroute(slow.__getitem__, MB, 3) is None
    assert _lagging(reroute_below=0.5).reroute(slow.__getitem__, MB, 3) is None, "nothing is queued on the primary"
    with pytest.raises(ValueError, match="reroute_below"):
        _lagging(reroute_below=1.5)


def test_explore_takes_the_fastest_auxiliary_path_through_the_asked_first_hop() -> None:
    s = PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=True)
    assert s.explore({4}) == AUX[1]
    assert s.in_flight == {PRIMARY: 0, AUX[0]: 0, AUX[1]: 1}
    assert s.explore({4}) is None, "the path is full"
    assert s.explore({2, 5}) is None, "no auxiliary path starts there"
    assert s.explore({3, 4}) == AUX[0]
    s.done(AUX[1])
    assert s.explore({3, 4}) == AUX[1]
    off = PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=False)
    assert off.explore({3, 4}) is None


def test_newer_beliefs_leave_out_paths_whose_later_hop_runs_behind_the_plan() -> None:
    s = _lagging(aux_queue_length=2)
    view = {2: LinkView(8 * MB, 1 * MB), 3: LinkView(0, 4 * MB), 4: LinkView(0, 4 * MB)}
    s.choose(view.__getitem__, MB)
    # 3 -> 2 is believed at 2.5 MB/s against the plan's 4: more than 30 % behind, so via 3 is out even
    # though its own estimate (0.25 + 0.4 s) beats via 4, 5's (0.75 s); 4 -> 5 at 3 MB/s is within 30 %.
    s.believe({(3, 2): 2.5 * MB, (4, 5): 3 * MB})
    assert s.blocked == {AUX[0]}
    assert s.choose(view.__getitem__, MB) == AUX[1]
    assert s.choose(view.__getitem__, MB) == AUX[1]
    assert s.choose(view.__getitem__, MB) == PRIMARY, "the only path left is full"
    assert s.reroute(view.__getitem__, MB, 3) is None and s.explore({3}) is None
    # Believed faster than planned, a later hop shortens the estimate: via 3 now 0.25 + 0.125 s.
    s.believe({(3, 2): 8 * MB})
    assert s.blocked == frozenset()
    s.done(AUX[1])
    assert s.choose(view.__getitem__, MB) == AUX[0]


def test_replanned_moves_replace_the_planned_offload_and_ignore_what_they_weighed() -> None:
    s = _lagging(busy_bound=100, offload=[(AUX[1], 0.5)])
    s.believe({(3, 2): 1 * MB, (4, 5): 1 * MB})
    assert s.blocked == {AUX[0], AUX[1]}
    assert {s.choose() for _ in range(4)} == {PRIMARY}, "the planned detour runs through a hop behind"
    s.amend([(AUX[0], 0.25)])
    assert s.blocked == {AUX[1]}
    chosen = [s.choose() for _ in range(8)]
    assert chosen.count(AUX[0]) == 2 and AUX[1] not in chosen
    s.take(AUX[0])
    assert s.in_flight[AUX[0]] == 3 and s.in_flight[PRIMARY] == 4 + 6 - 1
    with pytest.raises(ValueError, match="detours"):
        s.take(PRIMARY)
    with pytest.raises(ValueError, match="detour"):
        s.amend([((1, 2), 0.5)])
    with pytest.raises(ValueError, match="fraction"):
        s.amend([(AUX[0], 1.5)])
