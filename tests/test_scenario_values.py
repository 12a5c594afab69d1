"""Values a rate, a capacity or a count cannot take are scenario errors naming the file, the key and the
problem, in the WAN part (``netstorm.scenario``) and the LAN part (``netstorm.lan_scenario``) alike.

Each case writes a real TOML file (TOML reads ``nan`` and ``inf`` as floats) and loads it by path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from netstorm import scenario
from netstorm.errors import ScenarioError
from netstorm.lan_scenario import load_lan_file

WAN = """name = "values"
[[node]]
id = 1
{node}
[[node]]
id = 2
[[link]]
a = 1
b = 2
{link}
{extra}
"""

LAN = """name = "lan-values"
[[node]]
id = 1
[node.lan]
{lan}
[[node.lan.worker]]
{worker}
[[node]]
id = 2
[[link]]
a = 1
b = 2
rate_mbit = 100
"""

# (what the file says, the key the error must name, the problem it must state)
WAN_CASES = [
    ({"link": "rate_mbit = -5"}, "link[0].rate_mbit", "must be positive"),
    ({"link": "rate_mbit = 0"}, "link[0].rate_mbit", "must be positive"),
    ({"link": "rate_mbit = nan"}, "link[0].rate_mbit", "finite"),
    ({"link": "rate_mbit = inf"}, "link[0].rate_mbit", "finite"),
    ({"link": "rate_mbit = 1e12"}, "link[0].rate_mbit", "at most"),
    ({"link": "rate_mbit = [100, nan]"}, "link[0].rate_mbit[1]", "finite"),
    ({"link": 'rate_mbit = "fast"'}, "link[0].rate_mbit", "expected a number"),
    ({"link": "rate_mbit = 100\nlatency_ms = -1"}, "link[0].latency_ms", ">= 0"),
    ({"link": "rate_mbit = 100\nlatency_ms = inf"}, "link[0].latency_ms", "finite"),
    ({"link": "rate_mbit = 100\nlatency_ms = 1e9"}, "link[0].latency_ms", "at most"),
    ({"link": "rate_mbit = 100\nloss_pct = nan"}, "link[0].loss_pct", "finite"),
    ({"link": "rate_mbit = 100\nloss_pct = 100"}, "link[0].loss_pct", "below 100"),
    ({"node": "lan_workers = -1", "link": "rate_mbit = 100"}, "node[0].lan_workers", "integer in 0..64"),
    ({"node": "lan_workers = 2.5", "link": "rate_mbit = 100"}, "node[0].lan_workers", "whole number"),
    ({"node": "lan_workers = 1000000000", "link": "rate_mbit = 100"}, "node[0].lan_workers", "integer in 0..64"),
    ({"node": "", "link": "", "extra": "[rates]\nseed = 1\nrange_mbit = [0, 10]"}, "rates.range_mbit", "0 < low"),
    ({"link": "", "extra": "[rates]\nseed = 1\nrange_mbit = [1, 100000000000]"}, "rates.range_mbit", "high <="),
    ({"link": "rate_mbit = 100", "extra": "[dynamics]\nperiod_s = nan\nrange_mbit = [1, 10]"},
     "dynamics.period_s", "finite"),
    ({"link": "rate_mbit = 100", "extra": "[dynamics]\nperiod_s = 0\nrange_mbit = [1, 10]"},
     "dynamics.period_s", "must be positive"),
]

LAN_CASES = [
    ({"worker": "up_gbit = -1"}, "node[0].lan.worker[0].up_gbit", "must be positive"),
    ({"worker": "up_gbit = 0"}, "node[0].lan.worker[0].up_gbit", "must be positive"),
    ({"worker": "up_gbit = nan"}, "node[0].lan.worker[0].up_gbit", "finite"),
    ({"worker": "down_gbit = inf"}, "node[0].lan.worker[0].down_gbit", "finite"),
    ({"worker": "down_gbit = 1e9"}, "node[0].lan.worker[0].down_gbit", "at most"),
    ({"worker": "agg_gbit = -inf"}, "node[0].lan.worker[0].agg_gbit", "finite"),
    ({"worker": "agg_gbit = 0"}, "node[0].lan.worker[0].agg_gbit", "must be positive"),
    ({"worker": "compute_s = nan"}, "node[0].lan.worker[0].compute_s", "finite"),
    ({"worker": "compute_s = -0.5"}, "node[0].lan.worker[0].compute_s", ">= 0"),
    ({"worker": "compute_s = 1e12"}, "node[0].lan.worker[0].compute_s", "at most"),
    ({"lan": "gateway_gbit = nan"}, "node[0].lan.gateway_gbit", "finite"),
    ({"lan": "gateway_gbit = 0"}, "node[0].lan.gateway_gbit", "must be positive"),
    ({"lan": "gateway_gbit = 1e300"}, "node[0].lan.gateway_gbit", "at most"),
    ({"lan": "[[node.lan.rack]]\nid = 0\naggregator_gbit = nan", "worker": "rack = 0"},
     "node[0].lan.rack[0].aggregator_gbit", "finite"),
    ({"lan": "[[node.lan.rack]]\nid = 0\naggregator_gbit = 10\nuplink_gbit = -2", "worker": "rack = 0"},
     "node[0].lan.rack[0].uplink_gbit", "must be positive"),
    ({"lan": "[[node.lan.rack]]\nid = 1.5\naggregator_gbit = 10"}, "node[0].lan.rack[0].id", "whole number"),
    ({"lan": "[[node.lan.rack]]\nid = 0\naggregator_gbit = 10\nprecision_gbit = { fp16 = nan }"},
     "node[0].lan.rack[0].precision_gbit.fp16", "finite"),
    ({"lan": "[[node.lan.rack]]\nid = 0\naggregator_gbit = 10\nprecision_gbit = { fp16 = -1 }"},
     "node[0].lan.rack[0].precision_gbit.fp16", ">= 0"),
]

DRAW = """name = "lan-draw"
[[node]]
id = 1
[node.lan.draw]
{draw}
[[node]]
id = 2
[[link]]
a = 1
b = 2
rate_mbit = 100
"""

DRAW_CASES = [
    ("workers = 0", "node[0].lan.draw.workers", "integer in 1..64"),
    ("workers = 4.0", "node[0].lan.draw.workers", "whole number"),
    ("workers = 100000000", "node[0].lan.draw.workers", "integer in 1..64"),
    ("workers = 4\nmean_gbit = nan", "node[0].lan.draw.mean_gbit", "finite"),
    ("workers = 4\nmean_gbit = -10", "node[0].lan.draw.mean_gbit", "must be positive"),
    ("workers = 4\nspread = inf", "node[0].lan.draw.spread", "finite"),
    ("workers = 4\nspread = 1e6", "node[0].lan.draw.spread", "at most"),
    ("workers = 4\nmin_gbit = 0", "node[0].lan.draw.min_gbit", "must be positive"),
]


def _refused(tmp_path: Path, text: str, key: str, problem: str) -> None:
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as caught:
        scenario.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert problem in message, message


@pytest.mark.parametrize(("parts", "key", "problem"), WAN_CASES)
def test_a_wan_value_no_rate_or_count_can_take_is_refused_naming_file_key_and_problem(
        tmp_path: Path, parts: dict[str, str], key: str, problem: str) -> None:
    text = WAN.format(**{"node": "", "link": "rate_mbit = 100", "extra": "", **parts})
    _refused(tmp_path, text, key, problem)


@pytest.mark.parametrize(("parts", "key", "problem"), LAN_CASES)
def test_a_lan_value_no_rate_capacity_or_count_can_take_is_refused(
        tmp_path: Path, parts: dict[str, str], key: str, problem: str) -> None:
    _refused(tmp_path, LAN.format(**{"lan": "", "worker": "", **parts}), key, problem)


@pytest.mark.parametrize(("draw", "key", "problem"), DRAW_CASES)
def test_a_drawn_lan_with_an_impossible_value_is_refused(tmp_path: Path, draw: str, key: str, problem: str) -> None:
    _refused(tmp_path, DRAW.format(draw=draw), key, problem)


def test_more_workers_than_a_lan_holds_is_refused(tmp_path: Path) -> None:
    workers = "\n".join("[[node.lan.worker]]\nup_gbit = 10" for _ in range(65))
    text = LAN.format(lan="", worker="up_gbit = 10").replace("[[node.lan.worker]]\nup_gbit = 10", workers, 1)
    _refused(tmp_path, text, "node[0].lan.worker", "at most 64")


def test_a_lan_file_names_itself_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "dc.toml"
    path.write_text("gateway_gbit = 40\n[[worker]]\nup_gbit = nan\n")
    with pytest.raises(ScenarioError, match=rf"^{path}: lan\.worker\[0\]\.up_gbit: must be a finite number"):
        load_lan_file(str(path))


def test_the_shipped_scenarios_are_within_every_bound() -> None:
    for name in scenario.available():
        scenario.load(name)
