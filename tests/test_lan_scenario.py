"""A DC's LAN in the scenario: listed workers, drawn spreads, racks, and errors that name the key."""

from __future__ import annotations

import random
import statistics
import tomllib

import pytest

from netstorm import scenario
from netstorm.errors import ScenarioError
from netstorm.lan_scenario import DEFAULT_RATE_GBIT, PRECISIONS, lan_toml, load_lan_file, uniform_lan

RING = """
[[link]]
a = 1
b = 2
rate_mbit = 50
"""


def _load(node_toml: str, tmp_path, name: str = "s") -> scenario.Scenario:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\n{node_toml}\n[[node]]\nid = 2\n{RING}')
    return scenario.load(path)


def test_shipped_lan_scenario_describes_every_kind() -> None:
    s = scenario.load("lan-hetero-4")
    spread, racks, listed, plain = (s.node(i) for i in (1, 2, 3, 4))
    assert spread.lan is not None and spread.lan_workers == len(spread.lan.workers) == 8
    assert {w.precision for w in spread.lan.workers} == set(PRECISIONS)
    assert racks.lan is not None and {w.rack for w in racks.lan.workers} == {1, 2}
    assert listed.lan is not None and [w.up_gbit for w in listed.lan.workers] == [4.0, 4.0, 0.5, 0.5, 2.0, 2.0]
    assert [w.down_gbit for w in listed.lan.workers][2:4] == [2.0, 2.0]
    assert listed.lan.workers[4].down_gbit == 2.0  # down defaults to up
    assert [w.compute_s for w in listed.lan.workers] == [0.05] * 5 + [0.2]  # the table's default, then its own
    assert plain.lan is None and plain.lan_workers == 0


def test_draw_follows_its_seed_and_spread(tmp_path) -> None:
    s = _load("[[node]]\nid = 1\n[node.lan.draw]\nworkers = 40\nmean_gbit = 2.0\nspread = 0.3\nseed = 5\n", tmp_path)
    lan = s.node(1).lan
    assert lan is not None
    rng = random.Random(5)
    expected = [round(max(0.1, rng.gauss(2.0, 0.6)), 3) for _ in range(40)]
    assert [w.up_gbit for w in lan.workers] == expected
    assert [w.index for w in lan.workers] == list(range(40))
    assert 0.15 < statistics.stdev(expected) / statistics.mean(expected) < 0.45
    flat = _load("[[node]]\nid = 1\n[node.lan.draw]\nworkers = 4\nmean_gbit = 3.0\n", tmp_path, "flat")
    assert [w.up_gbit for w in flat.node(1).lan.workers] == [3.0] * 4  # type: ignore[union-attr]


def test_shipped_spread_sweep_varies_only_in_spread() -> None:
    """lan-spread's DCs are one sweep: the same eight fp32 workers, gateway and seed, only the spread
    differs; their drawn std over mean (population) is the one its description and results name."""
    s = scenario.load("lan-spread")
    drawn = {}
    for node in s.nodes:
        lan = node.lan
        assert lan is not None and len(lan.workers) == 8 and lan.gateway_gbit == 10.0
        assert {w.precision for w in lan.workers} == {"fp32"} and all(w.up_gbit >= 3.0 for w in lan.workers)
        rates = [w.up_gbit for w in lan.workers]
        assert rates == [w.down_gbit for w in lan.workers]
        drawn[node.id] = round(statistics.pstdev(rates) / statistics.mean(rates), 2)
    assert drawn == {1: 0.0, 2: 0.13, 3: 0.28, 4: 0.45, 5: 0.52, 6: 0.30, 7: 0.35, 8: 0.40, 9: 0.37}
    raw = tomllib.loads((scenario.SCENARIO_DIR / "lan-spread.toml").read_text())
    draws = [{k: v for k, v in n["lan"]["draw"].items() if k != "spread"} for n in raw["node"]]
    assert all(d == draws[0] for d in draws)


def test_lan_workers_count_alone_gives_uniform_workers(tmp_path) -> None:
    s = _load("[[node]]\nid = 1\nlan_workers = 3\n[node.lan]\nup_gbit = 1.5\nprecision = \"bf16\"\n", tmp_path)
    lan = s.node(1).lan
    assert lan is not None and [(w.up_gbit, w.down_gbit, w.precision) for w in lan.workers] == [(1.5, 1.5, "bf16")] * 3


@pytest.mark.parametrize("node, needle", [
    ("[node.lan]\nup_gbit = 1.0\n", "node[0].lan: give"),
    ("lan_workers = 2\n[node.lan.draw]\nworkers = 3\n", "describes 3 workers but the node's lan_workers is 2"),
    ("[[node.lan.worker]]\nprecision = \"fp8\"\n", "node[0].lan.worker[0].precision: expected one of"),
    ("[[node.lan.worker]]\nup_gbit = 0\n", "node[0].lan.worker[0].up_gbit: must be positive"),
    ("[[node.lan.worker]]\nrack = 3\n", "node[0].lan.worker[0].rack: unknown rack 3"),
    ("[[node.lan.worker]]\nspeed = 3\n", "unknown key 'speed'"),
    ("[node.lan.draw]\nworkers = 0\n", "node[0].lan.draw.workers: expected an integer in 1..64"),
    ("[node.lan.draw]\nworkers = 2\n[[node.lan.worker]]\n", "not both"),
    ("[[node.lan.rack]]\nid = 1\n", "node[0].lan.rack[0].aggregator_gbit: expected a number"),
    ("[[node.lan.rack]]\nid = 1\naggregator_gbit = 1\n[[node.lan.rack]]\nid = 1\naggregator_gbit = 1\n"
     "[[node.lan.worker]]\n", "duplicate rack id 1"),
    ("[[node.lan.worker]]\nagg_gbit = 0\n", "node[0].lan.worker[0].agg_gbit: must be positive"),
    ("[[node.lan.rack]]\nid = 1\naggregator_gbit = 1\nprecision_gbit = { fp8 = 1.0 }\n[[node.lan.worker]]\n",
     "node[0].lan.rack[0].precision_gbit: expected one of"),
    ("[[node.lan.rack]]\nid = 1\naggregator_gbit = 1\nprecision_gbit = { int8 = -1 }\n[[node.lan.worker]]\n",
     "node[0].lan.rack[0].precision_gbit.int8: must be >= 0"),
])
def test_bad_lan_tables_name_file_and_key(tmp_path, node: str, needle: str) -> None:
    tomllib.loads(f"[[node]]\nid = 1\n{node}")  # the case is valid TOML: only our validation rejects it
    with pytest.raises(ScenarioError) as err:
        _load(f"[[node]]\nid = 1\n{node}", tmp_path)
    assert needle in str(err.value) and "s.toml" in str(err.value)


def test_aggregation_capacities_per_worker_and_per_precision(tmp_path) -> None:
    s = _load("[[node]]\nid = 1\n[[node.lan.rack]]\nid = 1\naggregator_gbit = 8.0\n"
              "precision_gbit = { int8 = 0.0, fp16 = 3.0 }\n[node.lan.draw]\nworkers = 3\nagg_gbit = 5.0\n",
              tmp_path)
    lan = s.node(1).lan
    assert lan is not None and [w.agg_gbit for w in lan.workers] == [5.0] * 3
    rack = lan.rack(1)
    assert (rack.capacity("int8"), rack.capacity("fp16"), rack.capacity("fp32")) == (0.0, 3.0, 8.0)
    listed = _load("[[node]]\nid = 1\n[[node.lan.worker]]\nagg_gbit = 2.5\n[[node.lan.worker]]\n", tmp_path, "l")
    assert [w.agg_gbit for w in listed.node(1).lan.workers] == [2.5, None]  # type: ignore[union-attr]


def test_a_lan_written_alone_reads_back_as_it_was(tmp_path) -> None:
    """Every shipped description (drawn, racked, per-precision capacities, listed) survives ``lan_toml``."""
    written = 0
    for name in ("lan-hetero-4", "lan-planning", "lan-precision"):
        for dc in scenario.load(name).nodes:
            if dc.lan is None:
                continue
            path = tmp_path / f"{name}-{dc.id}.toml"
            path.write_text(lan_toml(dc.lan))
            assert load_lan_file(str(path)) == dc.lan
            written += 1
    assert written >= 6
    bad = tmp_path / "bad.toml"
    bad.write_text("[[worker]]\nup_gbit = -1\n")
    with pytest.raises(ScenarioError, match=r"bad.toml: lan.worker\[0\].up_gbit: must be positive"):
        load_lan_file(str(bad))


def test_a_resized_lan_keeps_the_descriptions_means_precisions_and_racks() -> None:
    listed = scenario.load("lan-hetero-4").node(3).lan   # six listed workers, two with slow uplinks
    assert listed is not None
    lan = uniform_lan(8, listed)
    assert len(lan.workers) == 8 and lan.gateway_gbit == listed.gateway_gbit
    mean = statistics.mean(w.up_gbit for w in listed.workers)
    assert [w.up_gbit for w in lan.workers] == pytest.approx([mean] * 8)
    mean = statistics.mean(w.down_gbit for w in listed.workers)
    assert [w.down_gbit for w in lan.workers] == pytest.approx([mean] * 8)
    mean = statistics.mean(w.compute_s for w in listed.workers)
    assert [w.compute_s for w in lan.workers] == pytest.approx([mean] * 8)
    assert [w.precision for w in lan.workers] == ["fp32", "fp16", "int8"] * 2 + ["fp32", "fp16"]
    racked = scenario.load("lan-hetero-4").node(2).lan
    assert racked is not None
    assert [w.rack for w in uniform_lan(5, racked).workers] == [1, 2, 1, 2, 1]
    plain = uniform_lan(3)
    assert [(w.up_gbit, w.down_gbit, w.precision, w.rack) for w in plain.workers] == \
        [(DEFAULT_RATE_GBIT, DEFAULT_RATE_GBIT, "fp32", None)] * 3
    with pytest.raises(ValueError):
        uniform_lan(0)
