"""The re-plan cadence: membership at once, measured shifts early but spaced, otherwise the period."""

from __future__ import annotations

import pytest

from netstorm.planning.plan import plan
from scheduler.cadence import Cadence, Reason, shifted, slows

PLANNED = {(1, 2): 100.0, (2, 1): 50.0}


def test_shift_is_relative_to_the_planned_rate_of_that_link() -> None:
    assert shifted(PLANNED, (1, 2), 131.0, 0.3)
    assert shifted(PLANNED, (1, 2), 69.0, 0.3)
    assert not shifted(PLANNED, (1, 2), 129.0, 0.3)
    assert not shifted(PLANNED, (1, 2), 71.0, 0.3)
    assert shifted(PLANNED, (2, 1), 66.0, 0.3) and not shifted(PLANNED, (2, 1), 64.0, 0.3)
    assert not shifted(PLANNED, (1, 2), 1000.0, 0.0), "0 turns early re-plans off"
    assert not shifted(None, (1, 2), 1000.0, 0.3), "nothing planned yet"
    assert not shifted(PLANNED, (1, 3), 1000.0, 0.3), "a link the plan does not have"


def test_a_shift_slows_the_policy_only_where_it_lengthens_its_busiest_link() -> None:
    # STAR at hub 1 over the links 1-2 and 1-3: every link carries the model once, so the busiest
    # links are 1-3's two directions at 50 Mbit/s; 1-2's run at 100 and have room.
    rates = {(1, 2): 100.0, (2, 1): 100.0, (1, 3): 50.0, (3, 1): 50.0}
    policy = plan(rates, topology="star", hub=1)
    assert not slows(policy, rates, {**rates, (1, 2): 60.0}, 0.3), "a 40 % drop with room to spare"
    assert not slows(policy, rates, {**rates, (3, 1): 40.0}, 0.3), "the busiest link, 25 % longer"
    assert slows(policy, rates, {**rates, (3, 1): 35.0}, 0.3), "the busiest link, 43 % longer"
    assert slows(policy, rates, {(2, 1): 30.0}, 0.3), "1-2 becomes the busiest, at 1.67x the old time"
    assert not slows(policy, rates, {**rates, (1, 3): 500.0, (3, 1): 500.0}, 0.3), "faster links wait"
    assert not slows(policy, rates, {**rates, (5, 6): 1.0}, 0.3), "links the plan does not have are ignored"


def test_quiet_cadence_is_the_update_period() -> None:
    c = Cadence(update_time=5.0, react_interval=1.0, now=100.0)
    assert c.due() == 105.0 and c.reason() is Reason.PERIODIC
    assert c.start(105.2) is Reason.PERIODIC
    assert c.due() == pytest.approx(110.2)


def test_a_shift_replans_after_react_interval_not_the_period_and_once_per_burst() -> None:
    c = Cadence(update_time=5.0, react_interval=1.0, now=100.0)
    c.shift()
    assert c.due() == 101.0 and c.reason() is Reason.SHIFT
    assert c.start(101.0) is Reason.SHIFT
    assert c.due() == 106.0, "the burst's signal was consumed"
    c.shift()
    c.shift()
    assert c.due() == 102.0, "the next early re-plan waits react_interval after the last one"
    assert c.start(102.0) is Reason.SHIFT and c.due() == 107.0


def test_react_interval_never_delays_beyond_the_period() -> None:
    c = Cadence(update_time=2.0, react_interval=10.0, now=0.0)
    c.shift()
    assert c.due() == 2.0


def test_membership_is_due_at_once_and_wins_over_a_shift() -> None:
    c = Cadence(update_time=5.0, react_interval=1.0, now=100.0)
    c.shift()
    c.member_down()
    assert c.due() <= 100.0 and c.reason() is Reason.MEMBERSHIP
    assert c.start(100.3) is Reason.MEMBERSHIP
    assert c.reason() is Reason.PERIODIC and c.due() == pytest.approx(105.3)


def test_a_network_change_is_due_at_once_and_later_shifts_wait_react_interval() -> None:
    c = Cadence(update_time=5.0, react_interval=1.0, now=100.0)
    assert c.start(100.1) is Reason.PERIODIC  # a cycle that found nothing to change
    c.change()
    assert c.due() <= 100.2 and c.reason() is Reason.SHIFT
    assert c.start(100.2) is Reason.SHIFT
    c.shift()
    assert c.due() == pytest.approx(101.2), "the next early re-plan waits react_interval"
    c.member_down()
    assert c.reason() is Reason.MEMBERSHIP


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="update_time"):
        Cadence(update_time=0.0, react_interval=1.0, now=0.0)
    with pytest.raises(ValueError, match="react_interval"):
        Cadence(update_time=1.0, react_interval=-1.0, now=0.0)
