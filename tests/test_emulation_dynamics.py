"""Rate dynamics: the schedule follows the scenario's epochs, and the player applies and logs them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from netstorm.emulation.dynamics import DynamicsPlayer, schedule
from netstorm.scenario import Rates, load

DATA = Path(__file__).parent / "data"


def test_schedule_scales_epoch_times_and_reuses_the_scenario_draws() -> None:
    scenario = load(DATA / "emu-4.toml")
    changes = schedule(scenario, time_scale=0.01, horizon_s=2.5)
    # period 60 s x 0.01 = 0.6 s: epochs 1..4 start at 0.6, 1.2, 1.8, 2.4 emulated seconds.
    assert [c.epoch for c in changes] == [1, 2, 3, 4]
    assert [round(c.t, 6) for c in changes] == [0.6, 1.2, 1.8, 2.4]
    for c in changes:
        assert c.rates == scenario.rates_at_epoch(c.epoch)
        assert all(10 <= r <= 30 for r in c.rates.values())
    assert schedule(load("internet2-9")) == []


class _Recorder:
    bw_scale = 0.5

    def __init__(self, expect: int) -> None:
        self.applied: list[Rates] = []
        self.done = threading.Event()
        self.expect = expect

    def set_rates(self, rates: Rates) -> None:
        self.applied.append(rates)
        if len(self.applied) == self.expect:
            self.done.set()


def test_player_applies_changes_in_order_and_logs_scaled_rates() -> None:
    scenario = load(DATA / "emu-4.toml")
    changes = schedule(scenario, time_scale=1e-4, horizon_s=0.03)
    assert len(changes) == 4
    target = _Recorder(len(changes))
    player = DynamicsPlayer(target, changes)
    player.start(scenario.rates())
    assert target.done.wait(10)
    player.stop()
    assert target.applied == [c.rates for c in changes]
    assert [e["epoch"] for e in player.log] == [0, 1, 2, 3, 4]
    first = changes[0].rates
    assert player.log[1]["rates_mbit"]["1->2"] == first[(1, 2)] * 0.5
    assert player.log[0]["rates_mbit"]["2->4"] == 12 * 0.5
    times = [e["t"] for e in player.log]
    assert times == sorted(times)
    # Each change says when re-shaping began, no later than when it ended, and after the change before.
    assert "t_begin" not in player.log[0]
    for before, entry in zip(player.log, player.log[1:], strict=False):
        assert before["t"] <= entry["t_begin"] <= entry["t"]


def test_player_stops_at_once_and_reports_a_failed_reshape() -> None:
    scenario = load(DATA / "emu-4.toml")

    class Failing:
        bw_scale = 1.0

        def set_rates(self, rates: Rates) -> None:
            raise RuntimeError("tc refused")

    player = DynamicsPlayer(Failing(), schedule(scenario, time_scale=1e-6, horizon_s=0.001))
    player.start(scenario.rates())
    assert player.join(10)
    with pytest.raises(RuntimeError, match="tc refused"):
        player.stop()
    assert len(player.log) == 1

    idle = DynamicsPlayer(Failing(), schedule(scenario, time_scale=1.0))
    idle.start(scenario.rates())
    idle.stop()  # returns without waiting 60 s for the first epoch
    assert len(idle.log) == 1


def test_anchored_player_waits_for_its_anchor_and_logs_from_start() -> None:
    scenario = load(DATA / "emu-4.toml")
    changes = schedule(scenario, time_scale=1e-4, horizon_s=0.03)
    target = _Recorder(len(changes))
    player = DynamicsPlayer(target, changes)
    player.start(scenario.rates(), anchored=True)
    # The whole schedule spans 0.024 s: ten times that without an anchor applies nothing.
    assert not target.done.wait(0.25)
    assert target.applied == [] and [e["epoch"] for e in player.log] == [0] and player.origin_s is None
    player.anchor()
    assert target.done.wait(10)
    player.anchor()  # a second anchor moves nothing
    player.stop()
    assert target.applied == [c.rates for c in changes]
    assert player.origin_s is not None and player.origin_s >= 0.25
    for entry, change in zip(player.log[1:], changes, strict=True):
        assert entry["t"] >= player.origin_s + change.t - 1e-3


def test_stopping_an_unanchored_player_applies_nothing() -> None:
    scenario = load(DATA / "emu-4.toml")
    target = _Recorder(1)
    player = DynamicsPlayer(target, schedule(scenario, time_scale=1e-4, horizon_s=0.03))
    player.start(scenario.rates(), anchored=True)
    player.stop()
    assert player.join(5)
    player.anchor()
    assert target.applied == [] and player.origin_s is None
