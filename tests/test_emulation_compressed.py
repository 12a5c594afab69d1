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


def test_an_entry_sets_its_rows_options() -> None:
    entries = compressed.parse("none,fediac,fediac:gia_reuse=4,fediac:k=0.2:bits=12")
    assert entries == ["none", "fediac", "fediac:gia_reuse=4", "fediac:k=0.2:bits=12"]
    assert [compressed.method_of(e) for e in entries] == ["none", "fediac", "fediac", "fediac"]
    assert compressed.row_flags("fediac:gia_reuse=4") == ["--fediac-gia-reuse", "4"]
    assert compressed.row_flags("fediac:k=0.2:bits=12") == ["--fediac-k", "0.2", "--fediac-bits", "12"]
    assert compressed.row_flags("fediac") == []
    assert compressed.row_name("netstorm", "fediac:gia_reuse=4") == "netstorm+fediac:gia_reuse=4"
    for bad, why in (("fediac:reuse=4", "NAME=VALUE"), ("fediac:gia_reuse=x", "number"),
                     ("fediac:gia_reuse=0", "fediac_gia_reuse"), ("fediac:bits", "NAME=VALUE"),
                     ("gzip:k=1", "gzip")):
        with pytest.raises(EmulationError, match=why):
            compressed.parse(bad)


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


def test_accuracy_lines_give_bytes_and_time_to_dense_final_accuracy() -> None:
    result = {"systems": {
        "netstorm": {"wan_bytes": [10**6, 10**6, 10**6, 10**6], "iteration_s": [2.0, 2.0, 2.0, 2.0],
                     "accuracy": [0.2, 0.5, 0.7, 0.8], "added_latency_s": 0.0},
        "netstorm+fediac": {"wan_bytes": [10**6, 4 * 10**5, 4 * 10**5, 4 * 10**5], "iteration_s": [2.0, 1.0, 1.0, 1.0],
                            "accuracy": [0.2, 0.6, 0.81, 0.79], "added_latency_s": 0.5},
        "netstorm+topk": {"wan_bytes": [9 * 10**5] * 4, "iteration_s": [1.0, 1.0, 1.0, 1.0],
                          "accuracy": [0.1, 0.2, 0.3, 0.4], "added_latency_s": 0.5},
    }}
    lines = compressed.accuracy_lines(result)
    rows = {line.split()[0]: line.split() for line in lines[3:-1]}
    assert rows["netstorm"][1:5] == ["0.800", "+0.0", "1.00", "it"] and rows["netstorm"][5:8] == ["4", "4.0", "8.0"]
    # fediac: 400 of 1000 bytes after the first iteration, dense's 0.8 first reached at iteration 3,
    # 1.8 MB and 4 s until then, and 3 iterations x 0.5 s of a vote round trip at the latency
    assert rows["netstorm+fediac"][1:] == ["0.790", "-1.0", "0.40", "it", "3", "1.8", "4.0", "1.5"]
    assert rows["netstorm+topk"][1:5] == ["0.400", "-40.0", "0.90", "not"]


def test_the_summary_of_a_run_that_completed_no_iteration_says_nan_instead_of_failing() -> None:
    from netstorm.emulation.compressed import summary_lines

    failed: dict[str, Any] = {"systems": {"netstorm": {"wan_bytes": [], "iteration_s": [], "link_over_node_bytes": None,
                                       "round_trips_per_iteration": 1.0, "added_latency_s": 0.0}}}
    lines = summary_lines(failed)
    row = next(line for line in lines if line.startswith("netstorm"))
    assert row.split()[1:4] == ["nan", "1.00", "nan"]
