"""ProbeEstimator against hand-checked cases and a simulated bottleneck link."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.probe import LinkReport, ProbeEstimator

MB = 1_000_000


def simulate_link(t_send: np.ndarray, sizes: np.ndarray, mbit_s: float, latency: float) -> np.ndarray:
    """Arrival of each chunk's last byte on a FIFO bottleneck of ``mbit_s`` with one-way ``latency``."""
    rate = mbit_s * 1e6 / 8
    arrivals = np.empty_like(t_send)
    free_at = -np.inf
    for i in range(len(t_send)):  # a reference model, not a data path
        free_at = max(t_send[i], free_at) + sizes[i] / rate
        arrivals[i] = free_at + latency
    return arrivals


def feed(est: ProbeEstimator, sizes, t_send, t_last) -> list[LinkReport]:
    reports = []
    for n, ts, tr in zip(sizes, t_send, t_last, strict=True):
        rep = est.on_chunk(int(n), float(ts), float(tr))
        if rep is not None:
            reports.append(rep)
    return reports


def test_idle_chunks_give_bytes_over_one_way_time():
    # Eq. 14 averaged: 4 isolated chunks, each sent long after the previous arrived.
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=4)
    sizes = [MB, 2 * MB, MB, 4 * MB]
    t_send = [0.0, 10.0, 20.0, 30.0]
    t_last = [0.5, 11.5, 20.25, 32.0]
    reports = feed(est, sizes, t_send, t_last)
    assert len(reports) == 1
    expected = 8 * 8 * MB / (0.5 + 1.5 + 0.25 + 2.0) / 1e6
    assert reports[0].mbit_s == pytest.approx(expected)
    assert reports[0] == LinkReport(1, 2, reports[0].mbit_s, 32.0, 4, warm=False)


def test_back_to_back_chunks_are_not_charged_for_queueing():
    # Five 1 MB chunks handed to the socket at once on an 8 Mbit/s link with 50 ms latency: the last
    # byte of chunk i arrives at 1.05 + i s. Naively chunk 4 would be charged 5.05 s for 1 MB.
    est = ProbeEstimator(3, 4, probe_chunk_bytes=MB, probe_chunk_num=4)
    t_last = [1.05, 2.05, 3.05, 4.05, 5.05]
    reports = feed(est, [MB] * 5, [0.0] * 5, t_last)
    assert len(reports) == 1
    # Window = chunks 0..3; chunk 0 is cold (latency included), 1..3 are warm and exact: 1 s each.
    assert reports[0].mbit_s == pytest.approx(8.0)
    assert reports[0].samples == 4 and reports[0].t == 4.05


def test_small_chunks_are_ignored_but_still_queue_the_next():
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=1)
    assert est.on_chunk(1000, 0.0, 0.3) is None  # below the probe size: no sample
    rep = est.on_chunk(MB, 0.0, 1.3)  # waited 0.3 s behind the small one
    assert rep is not None
    assert rep.mbit_s == pytest.approx(8.0)


def test_only_cold_samples_when_nothing_is_warm():
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=2)
    assert est.on_chunk(MB, 0.0, 1.1) is None
    rep = est.on_chunk(MB, 5.0, 6.1)
    assert rep is not None
    assert rep.mbit_s == pytest.approx(16 / 2.2)


def test_a_window_grows_until_its_samples_span_the_shortest_window():
    est = ProbeEstimator(1, 2, probe_chunk_bytes=1000, probe_chunk_num=2, min_window_s=0.1)
    t = 0.0
    reports: list[LinkReport | None] = []
    for _ in range(7):  # 1000-byte chunks back to back, 30 ms each; one stamp arrives 9 ms late
        t += 0.03
        reports.append(est.on_chunk(1000, 0.0, t + (0.009 if len(reports) == 2 else 0.0)))
    # The first sample is cold, so the warm ones count alone: two of them span 60 ms, not yet; the fifth
    # chunk makes four warm samples over 120 ms (the late stamp cancels out), and the window starts over.
    assert [r is not None for r in reports] == [False, False, False, False, True, False, False]
    report = reports[4]
    assert report is not None and report.samples == 5 and report.warm
    assert report.mbit_s == pytest.approx(4000 * 8 / 0.12 / 1e6)
    with pytest.raises(ValueError, match="min_window_s"):
        ProbeEstimator(1, 2, probe_chunk_bytes=1000, probe_chunk_num=2, min_window_s=-1.0)


def test_cold_and_warm_reports_are_flagged():
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=2)
    assert est.on_chunk(MB, 0.0, 1.1) is None
    cold = est.on_chunk(MB, 5.0, 6.1)  # sent after the first had arrived: the link was idle
    assert cold is not None and not cold.warm
    assert est.on_chunk(MB, 6.0, 7.1) is None  # sent while the one before was arriving
    warm = est.on_chunk(MB, 7.0, 8.1)
    assert warm is not None and warm.warm


@pytest.mark.parametrize("seed", range(5))
def test_exact_rate_for_any_send_schedule_without_latency(seed):
    # With no propagation delay every sample, warm or cold, is pure serialization time.
    rng = np.random.default_rng(seed)
    n = 40
    sizes = rng.integers(MB, 4 * MB, n).astype(float)
    t_send = np.cumsum(rng.exponential(0.3, n))
    t_last = simulate_link(t_send, sizes, 37.0, 0.0)
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=4)
    reports = feed(est, sizes, t_send, t_last)
    assert len(reports) == n // 4
    assert [r.mbit_s for r in reports] == pytest.approx([37.0] * len(reports), rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_latency_only_ever_lowers_the_estimate_by_at_most_one_latency_per_chunk(seed):
    rng = np.random.default_rng(100 + seed)
    n = 60
    sizes = rng.integers(MB, 3 * MB, n).astype(float)
    t_send = np.cumsum(rng.exponential(0.4, n))
    latency = 0.03
    t_last = simulate_link(t_send, sizes, 50.0, latency)
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=4)
    reports = feed(est, sizes, t_send, t_last)
    floor = 50.0 * MB / (MB + latency * 50e6 / 8)  # the smallest chunk carrying a full latency
    for r in reports:
        assert floor - 1e-9 <= r.mbit_s <= 50.0 + 1e-9


def test_streaming_is_immune_to_clock_offset():
    # Chunks handed over together; the sender's clock is off by -0.4 s or +0.2 s (less than one chunk's
    # serialization time). Warm samples use only the receiver's stamps, so every report is exact.
    sizes = np.full(8, 2.0 * MB)
    t_send = np.zeros(8)
    t_last = simulate_link(t_send, sizes, 20.0, 0.01)
    for offset in (-0.4, 0.2):
        est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=4)
        reports = feed(est, sizes, t_send + offset, t_last)
        assert [r.mbit_s for r in reports] == pytest.approx([20.0, 20.0], rel=1e-9)


def test_non_positive_duration_is_dropped_not_reported():
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=1)
    assert est.on_chunk(MB, 5.0, 4.0) is None  # sender clock ahead of the arrival: impossible sample
    assert est.dropped == 1
    rep = est.on_chunk(MB, 4.5, 5.0)  # sent after the previous arrived: cold, 0.5 s
    assert rep is not None and rep.mbit_s == pytest.approx(16.0)


@pytest.mark.parametrize(("nbytes", "ts", "tr"), [(-1, 0.0, 1.0), (MB, float("nan"), 1.0), (MB, 0.0, float("inf"))])
def test_bad_stamps_raise_and_keep_state(nbytes, ts, tr):
    est = ProbeEstimator(1, 2, probe_chunk_bytes=MB, probe_chunk_num=2)
    est.on_chunk(MB, 0.0, 1.0)
    with pytest.raises(ValueError, match="1->2"):
        est.on_chunk(nbytes, ts, tr)
    rep = est.on_chunk(MB, 0.5, 2.0)
    assert rep is not None and rep.mbit_s == pytest.approx(8.0)


@pytest.mark.parametrize("kwargs", [{"probe_chunk_bytes": 0, "probe_chunk_num": 4},
                                    {"probe_chunk_bytes": MB, "probe_chunk_num": 0}])
def test_rejects_nonsense_configuration(kwargs):
    with pytest.raises(ValueError):
        ProbeEstimator(1, 2, **kwargs)
