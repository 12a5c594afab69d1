"""What a gateway measures of its LAN tier, by plain calls: every collected sum is counted, its phase
timed from the previous result's release (when that is still known), failures counted, and measured
rates reported only when someone takes reports and they moved enough."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from netstorm.lan.tiermeasures import LanMeasures, lan_losses
from netstorm.lan_scenario import LanSpec, LanWorker

MB = 1_000_000


def _spec() -> LanSpec:
    return LanSpec(workers=tuple(LanWorker(i, up_gbit=10.0, down_gbit=10.0) for i in range(3)))


def test_a_collected_sum_is_counted_and_its_phase_timed_from_the_previous_release(
        caplog: pytest.LogCaptureFixture) -> None:
    measures = LanMeasures(None, change=0.2, interval=0.0)
    measures.collected(1, 8 * MB, (0.5, 1.0), asked=0.2, now=1.1, first_handed=None)   # nothing released before
    assert (measures.lan_iterations, measures.lan_bytes, measures.lan_seconds) == (1, 8 * MB, 0.0)
    measures.released(1, 2.0)
    with caplog.at_level(logging.INFO, logger="netstorm.edge"):
        measures.collected(2, 8 * MB, (2.25, 2.5), asked=2.1, now=2.6, first_handed=2.3)
    assert measures.lan_iterations == 2 and measures.lan_bytes == 16 * MB
    assert measures.lan_seconds == pytest.approx(0.5) and measures.lan_last_gbit == pytest.approx(8 * MB * 8 / 0.5e9)
    assert "iteration 2: LAN first chunk summed 0.250 s and last 0.500 s" in caplog.text
    assert "first part went to the WAN step 0.300 s after that release" in caplog.text
    measures.failed()
    assert measures.lan_failures == 1 and measures.lan_iterations == 2


def test_only_the_newest_releases_are_kept_as_references() -> None:
    measures = LanMeasures(None, change=0.2, interval=0.0)
    measures.released(1, 1.0)
    measures.released(6, 6.0)   # iteration 1 is more than four back: forgotten
    measures.collected(2, MB, (1.5, 2.0), asked=1.2, now=2.0, first_handed=None)
    assert measures.lan_seconds == 0.0 and measures.lan_last_gbit == 0.0
    measures.collected(7, MB, (6.5, 7.0), asked=6.2, now=7.0, first_handed=None)
    assert measures.lan_seconds == pytest.approx(1.0)


def _slow_bursts() -> list[tuple[str, tuple[int, int, float, float]]]:
    """Worker 0 achieves 1 Gbit/s (1 MB in 8 ms), the others their description's 10; worker 9 is not on
    this LAN."""
    return [("up", (w, MB, 0.0, MB * 8 / ((1.0 if w == 0 else 10.0) * 1e9))) for w in range(3)] + \
        [("up", (9, MB, 0.0, 0.001))]


def test_measured_rates_are_reported_once_they_moved_and_only_to_someone_who_takes_reports() -> None:
    measures = LanMeasures(_spec(), change=0.2, interval=0.0)
    for k in range(3):   # moved, but nobody takes reports
        assert measures.measured(_slow_bursts(), {}, {}, float(k), reporting=False) is None
    report = measures.measured(_slow_bursts(), {}, {}, 3.0, reporting=True)
    assert report is not None and report.workers[0].up_gbit == pytest.approx(1.0)
    assert [w.up_gbit for w in report.workers[1:]] == pytest.approx([10.0, 10.0])
    assert measures.measured(_slow_bursts(), {}, {}, 4.0, reporting=True) is None   # reported: not moved since
    assert LanMeasures(None, change=0.2, interval=0.0).measured(_slow_bursts(), {}, {}, 0.0, reporting=True) is None


def test_lan_losses_read_the_agents_counts_and_are_zero_without_them() -> None:
    assert lan_losses(None) == {"nack": 0, "query_nack": 0, "cluster_nack": 0}
    agent = SimpleNamespace(nack_datagrams=3, query_nacks_sent=2, cluster_nacks_sent=1)
    assert lan_losses(agent) == {"nack": 3, "query_nack": 2, "cluster_nack": 1}
