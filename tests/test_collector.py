"""LinkCollector: latest reports, decay of stale links toward the optimum, relative change."""

from __future__ import annotations

import itertools
import math

import pytest

from netstorm.probe import LinkReport
from scheduler.collector import LinkCollector

INITIAL = {(1, 2): 100.0, (2, 1): 80.0, (2, 3): 20.0, (3, 2): 40.0}


def test_fresh_values_are_believed_as_they_are():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0, half_life=60.0)
    assert c.estimate(10.0) == INITIAL
    c.add(LinkReport(2, 3, 55.5, 12.0, 4), now=12.0)
    # The initial rate is the first vote: one report moves the belief halfway, the second decides.
    assert c.estimate(13.0) == {**INITIAL, (2, 3): (20.0 + 55.5) / 2}
    c.add(LinkReport(2, 3, 55.5, 14.0, 4), now=14.0)
    assert c.estimate(20.0) == {**INITIAL, (2, 3): 55.5}
    assert c.state(2, 3).measured and c.state(2, 3).samples == 4
    assert c.state(2, 3).recent == (20.0, 55.5, 55.5)
    assert not c.state(1, 2).measured


def test_the_initial_rate_ages_out_like_a_report():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0, half_life=60.0)
    c.add(LinkReport(2, 3, 55.5, 31.0, 4), now=31.0)  # later than stale_after: the prior says nothing now
    assert c.state(2, 3).mbit_s == 55.5 and c.state(2, 3).recent == (55.5,)


def test_a_lone_outlier_is_dropped_and_a_real_change_followed_from_its_second_report():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0)
    for t, rate in ((1.0, 50.0), (2.0, 52.0), (3.0, 51.0)):
        c.add(LinkReport(1, 2, rate, t, 4), now=t)
    assert c.state(1, 2).mbit_s == 51.0
    c.add(LinkReport(1, 2, 140.0, 4.0, 4), now=4.0)  # one report far too fast
    assert c.state(1, 2).mbit_s == 52.0 and c.state(1, 2).latest == 140.0
    c.add(LinkReport(1, 2, 20.0, 5.0, 4), now=5.0)  # the rate really drops...
    assert c.state(1, 2).mbit_s == 51.0
    c.add(LinkReport(1, 2, 21.0, 6.0, 4), now=6.0)  # ...and the second report carries it
    assert c.state(1, 2).mbit_s == 21.0
    assert c.state(1, 2).recent == (140.0, 20.0, 21.0)


WIDE = {(a, b): 50.0 for a in range(1, 6) for b in range(1, 6) if a != b}


def test_a_change_is_seen_when_several_links_leave_their_plan_and_one_of_them_twice():
    c = LinkCollector(WIDE, now=0.0, stale_after=30.0)
    steady = [(1, 2), (2, 1), (3, 4), (4, 3), (2, 5), (5, 2), (1, 5)]
    for t in (1.0, 5.0):  # first reports count for nothing; then every link near its plan
        for link in [*steady, (4, 5), (5, 4), (1, 3), (3, 1)]:
            c.add(LinkReport(*link, 55.0, t, 4), now=t)
    # A host stall skews one report of four links: none left its plan twice, so no change.
    for i, link in enumerate([(4, 5), (5, 4), (1, 3), (3, 1)]):
        c.add(LinkReport(*link, 10.0, 5.2 + i / 100, 4), now=5.2 + i / 100)
    assert c.change_seen(WIDE, 0.3, now=5.3) is None
    for i, link in enumerate([(4, 5), (5, 4), (1, 3), (3, 1)]):  # and back
        c.add(LinkReport(*link, 50.0, 5.4 + i / 100, 4), now=5.4 + i / 100)
    assert c.change_seen(WIDE, 0.3, now=5.5) is None
    for link in steady:
        c.add(LinkReport(*link, 56.0, 6.05, 4), now=6.05)
    # A real change: 4->5 twice below its plan...
    for t in (6.1, 6.3):
        c.add(LinkReport(4, 5, 20.0, t, 4), now=t)
    assert c.moved((4, 5), 50.0, 0.3) == -1 and c.moved((1, 2), 50.0, 0.3) == 0
    assert c.change_seen(WIDE, 0.3, now=6.3) is None, "one link: its own change, not the network's"
    c.add(LinkReport(5, 4, 90.0, 6.35, 4), now=6.35)
    c.add(LinkReport(1, 3, 10.0, 6.4, 4), now=6.4)
    assert c.change_seen(WIDE, 0.3, now=6.4) is None, "three links away, fewer than half of the seven near"
    c.add(LinkReport(1, 2, 5.0, 6.5, 4), now=6.5)
    assert c.change_seen(WIDE, 0.3, now=6.5) == 6.1, "four away against six near: it began at 6.1 s"
    assert c.change_seen(WIDE, 0.3, now=8.0) is None, "the window is past"


def test_every_link_slower_at_once_is_a_busy_host_not_a_network_change():
    c = LinkCollector(WIDE, now=0.0, stale_after=30.0)
    links = sorted(WIDE)[:6]
    for t, rate in ((1.0, 50.0), (2.0, 25.0), (2.1, 24.0)):  # first reports, then all read half, twice
        for link in links:
            c.add(LinkReport(*link, rate, t, 4), now=t)
    assert all(c.moved(link, 50.0, 0.3) == -1 for link in links)
    assert c.change_seen(WIDE, 0.3, now=2.2) is None
    c.add(LinkReport(*links[0], 90.0, 2.2, 4), now=2.2)  # one link faster: rates really moved both ways
    assert c.change_seen(WIDE, 0.3, now=2.3) == 2.0


def test_a_change_point_drops_older_reports_and_pulls_unmeasured_links_halfway_to_the_measured():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0)
    for t, rate in ((1.0, 100.0), (2.0, 101.0), (3.0, 99.0)):
        c.add(LinkReport(1, 2, rate, t, 4), now=t)
    c.add(LinkReport(2, 1, 80.0, 3.5, 4), now=3.5)
    # The network changes at 4 s: 1->2 reports 30 twice; the median of three still says 99 after the first.
    c.add(LinkReport(1, 2, 30.0, 4.2, 4), now=4.2)
    assert c.state(1, 2).mbit_s == 99.0
    c.add(LinkReport(2, 3, 60.0, 4.4, 4), now=4.4)
    c.add(LinkReport(1, 2, 31.0, 4.6, 4), now=4.6)
    assert c.note_change(4.2, change_gap=5.0)
    assert c.change_at == 4.2
    assert c.state(1, 2).recent == (30.0, 31.0) and c.state(1, 2).mbit_s == 30.5
    assert c.state(2, 3).recent == (60.0,) and c.state(2, 3).mbit_s == 60.0  # its first report alone decides
    assert c.unconfirmed(2, 1) and c.unconfirmed(3, 2) and not c.unconfirmed(2, 3)
    typical = (30.5 + 60.0) / 2  # the median of the links measured since the change
    est = c.estimate(5.0)
    assert est[(1, 2)] == 30.5 and est[(2, 3)] == 60.0
    assert est[(2, 1)] == pytest.approx((80.0 + typical) / 2)
    assert est[(3, 2)] == pytest.approx((40.0 + typical) / 2)
    # A mark within change_gap is the same change, seen later on other links.
    assert not c.note_change(6.0, change_gap=5.0) and c.change_at == 4.2
    # Measured again, a link is believed as measured: its reports from before the change are gone.
    c.add(LinkReport(2, 1, 20.0, 7.0, 4), now=7.0)
    assert not c.unconfirmed(2, 1) and c.estimate(7.0)[(2, 1)] == 20.0
    assert c.note_change(9.5, change_gap=5.0) and c.change_at == 9.5


def test_a_change_point_with_nothing_measured_since_changes_no_estimate():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0)
    c.add(LinkReport(1, 2, 50.0, 1.0, 4), now=1.0)
    assert c.note_change(2.0, change_gap=5.0)
    assert all(c.unconfirmed(*link) for link in INITIAL)
    assert c.estimate(3.0) == {**INITIAL, (1, 2): 75.0}


def test_reports_older_than_stale_after_are_not_in_the_median():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0)
    c.add(LinkReport(2, 3, 20.0, 1.0, 4), now=1.0)
    c.add(LinkReport(2, 3, 21.0, 2.0, 4), now=2.0)
    c.add(LinkReport(2, 3, 90.0, 100.0, 4), now=100.0)
    assert c.state(2, 3).mbit_s == 90.0 and c.state(2, 3).recent == (90.0,)


def test_stale_link_decays_halfway_to_the_best_rate_per_half_life():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0, half_life=60.0)
    c.add(LinkReport(1, 2, 100.0, 89.0, 4), now=89.0)  # keeps (1, 2) fresh; target = 100
    est = c.estimate(90.0)  # 60 s past the 30 s horizon for the never-measured links: one half-life
    assert est[(1, 2)] == 100.0
    assert est[(2, 1)] == pytest.approx(90.0)  # 80 + (100 - 80) / 2
    assert est[(2, 3)] == pytest.approx(60.0)  # 20 + (100 - 20) / 2
    assert est[(3, 2)] == pytest.approx(70.0)
    assert c.estimate(150.0)[(2, 3)] == pytest.approx(80.0)  # two half-lives: 3/4 of the way


def test_an_unused_slow_link_eventually_looks_best_enough_to_be_tried():
    # The avalanche effect: (2, 3) is never measured because no tree uses it. Its estimate must rise
    # monotonically and overtake every other link's fresh value, so a re-plan will try it.
    c = LinkCollector(INITIAL, now=0.0)
    seen = []
    for t in range(0, 600, 5):
        for link in ((1, 2), (2, 1), (3, 2)):
            c.add(LinkReport(*link, INITIAL[link], t, 4), now=float(t))
        seen.append(c.estimate(float(t))[(2, 3)])
    assert all(b >= a for a, b in itertools.pairwise(seen))
    assert seen[0] == 20.0 and seen[-1] > 80.0  # above the (2, 1) and (3, 2) links' 80 and 40


def test_a_new_report_resets_the_decay():
    c = LinkCollector(INITIAL, now=0.0, stale_after=30.0, half_life=60.0)
    assert c.estimate(200.0)[(2, 3)] > 80.0
    c.add(LinkReport(2, 3, 21.0, 200.0, 4), now=200.0)
    assert c.estimate(210.0)[(2, 3)] == 21.0


def test_decay_can_be_turned_off():
    c = LinkCollector(INITIAL, now=0.0, stale_after=math.inf)
    assert c.estimate(1e6) == INITIAL


@pytest.mark.parametrize("report", [LinkReport(3, 1, 10.0, 0.0, 4), LinkReport(1, 2, 0.0, 0.0, 4),
                                    LinkReport(1, 2, -5.0, 0.0, 4), LinkReport(1, 2, math.nan, 0.0, 4),
                                    LinkReport(1, 2, math.inf, 0.0, 4)])
def test_bad_reports_raise_and_change_nothing(report):
    c = LinkCollector(INITIAL, now=0.0)
    with pytest.raises(ValueError, match=f"{report.src}->{report.dst}"):
        c.add(report, now=1.0)
    assert c.estimate(1.0) == INITIAL


def test_bad_initial_rates_raise():
    with pytest.raises(ValueError, match="2->3"):
        LinkCollector({(1, 2): 10.0, (2, 3): 0.0}, now=0.0)
    with pytest.raises(ValueError):
        LinkCollector({}, now=0.0)


def test_relative_change_is_the_largest_per_link_change():
    old = {(1, 2): 100.0, (2, 1): 50.0}
    assert LinkCollector.relative_change(old, dict(old)) == 0.0
    assert LinkCollector.relative_change(old, {(1, 2): 110.0, (2, 1): 25.0}) == pytest.approx(0.5)
    assert LinkCollector.relative_change(old, {(1, 2): 300.0, (2, 1): 50.0}) == pytest.approx(2.0)
    assert LinkCollector.relative_change(old, {(1, 2): 100.0}) == math.inf
    assert LinkCollector.relative_change({}, {}) == 0.0
