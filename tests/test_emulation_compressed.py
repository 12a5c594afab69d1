"""Compression rows of the emulator: names, per-iteration WAN bytes, the latency an extra round adds."""

from __future__ import annotations

from typing import Any

import pytest

from netstorm.emulation import compressed
from netstorm.emulation.errors import EmulationError
from netstorm.scenario import load


def test_rows_are_named_per_compression() -> None:
    assert compressed.parse("none, fediac,topk,fp16,fediac") == ["none", "fediac", "topk", "fp16"]
    assert compressed.parse(None) == ["none"]
    with pytest.raises(EmulationError, match="gzip"):
        compressed.parse("none,gzip")
    assert compressed.row_name("netstorm", "none") == "netstorm"
    assert compressed.row_name("netstorm", "fediac") == "netstorm+fediac"


def test_collect_sums_the_dcs_bytes_per_iteration_and_checks_they_agree() -> None:
    records: dict[str, list[dict[str, Any]]] = {
        "1": [{"iteration": 0, "wan_bytes": 100, "round_trips": 1, "gia": 0, "rel_error": 0.0},
              {"iteration": 1, "wan_bytes": 40, "round_trips": 2, "gia": 7, "rel_error": 0.5, "round_s": [0.5, 0.2]}],
        "2": [{"iteration": 0, "wan_bytes": 300, "round_trips": 1, "gia": 0, "rel_error": 0.0},
              {"iteration": 1, "wan_bytes": 60, "round_trips": 2, "gia": 7, "rel_error": 0.5, "round_s": [0.7, 0.1]}],
    }
    stats = compressed.collect(records, 3)
    assert stats["wan_bytes"] == [400, 100] and stats["wan_bytes_total"] == 500
    assert stats["round_trips"] == [1, 2] and stats["gia"] == [0, 7] and stats["dcs_agree"] is True
    assert stats["vote_round_s"] == [0.7]
    records["2"][1]["rel_error"] = 0.25
    assert compressed.collect(records, 3)["dcs_agree"] is False
    plain = compressed.collect({"1": [{"iteration": 0, "wan_bytes": 5}]}, 1)
    assert plain == {"wan_bytes": [5], "round_trips": [1], "wan_bytes_total": 5}


def test_a_round_trip_is_up_and_down_the_deepest_tree_at_the_link_latencies() -> None:
    scenario = load("internet2-9")
    hop = scenario.links[0].latency_ms / 1000
    a, b = scenario.links[0].a, scenario.links[0].b
    chain = {str(a): None, str(b): a}
    assert compressed.tree_round_trip_s({str(a): chain}, scenario) == pytest.approx(2 * hop)
    note = compressed.latency_note({"round_trips": [1, 2, 2]}, {str(a): chain}, scenario)
    assert note == {"round_trips_per_iteration": 2.0, "tree_round_trip_s": round(2 * hop, 4),
                    "added_latency_s": round(2 * hop, 4)}
