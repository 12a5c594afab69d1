"""PathScheduler follows the paper's Fig. 7 rule, checked by hand and against a direct restatement."""

from __future__ import annotations

import random

import pytest

from netstorm.sendsched import PathScheduler

PRIMARY = (1, 2)
AUX = [(1, 3, 2), (1, 4, 5, 2)]


def test_primary_until_more_than_busy_bound_then_fastest_aux_then_primary():
    s = PathScheduler(PRIMARY, AUX, busy_bound=2, aux_queue_length=1, enabled=True)
    chosen = [s.choose() for _ in range(7)]
    # 0, 1, 2 in flight on the primary -> primary (3 in flight is more than the bound of 2);
    # then each auxiliary path once, fastest first; then every path is busy -> primary.
    assert chosen == [PRIMARY, PRIMARY, PRIMARY, AUX[0], AUX[1], PRIMARY, PRIMARY]
    assert s.in_flight == {PRIMARY: 5, AUX[0]: 1, AUX[1]: 1}


def test_an_auxiliary_path_starts_only_on_an_idle_first_hop():
    s = PathScheduler(PRIMARY, AUX, busy_bound=0, aux_queue_length=1, enabled=True)
    assert s.choose(lambda hop: False) == PRIMARY
    assert s.choose(lambda hop: hop == 4) == AUX[1], "the fastest path's first hop (3) is busy"
    assert s.choose(lambda hop: hop == 4) == PRIMARY, "the idle path is full, the other's hop busy"
    assert s.choose(lambda hop: True) == AUX[0]
    assert s.in_flight == {PRIMARY: 2, AUX[0]: 1, AUX[1]: 1}


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
