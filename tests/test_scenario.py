from __future__ import annotations

import random

import pytest

from netstorm import scenario
from netstorm.errors import ScenarioError
from netstorm.planning.limit import min_cut

EDGES = [(1, 2), (1, 3), (2, 3), (2, 5), (3, 4), (4, 5), (4, 6), (5, 7), (6, 7), (6, 8), (6, 9), (7, 8), (8, 9)]


def test_internet2_is_the_papers_overlay_with_reference_rates() -> None:
    s = scenario.load("internet2-9")
    assert s.node_ids == list(range(1, 10))
    assert [(lk.a, lk.b) for lk in s.links] == EDGES
    rng = random.Random(1)
    for lk in s.links:
        assert lk.rate_ab_mbit == rng.randint(20, 155)
        assert lk.rate_ba_mbit == rng.randint(20, 155)
        assert lk.latency_ms == 30.0
        assert lk.loss == pytest.approx(0.0002)
    assert s.dynamics is None


def test_dynamic_variant_redraws_deterministically() -> None:
    s = scenario.load("internet2-9-dynamic")
    assert s.rates() == scenario.load("internet2-9").rates()
    assert s.dynamics is not None and s.dynamics.period_s == 180.0
    sched = list(s.rate_schedule(400.0))
    assert [t for t, _ in sched] == [0.0, 180.0, 360.0]
    assert sched[1][1] == s.rates_at_epoch(1) != sched[0][1]
    assert all(20 <= r <= 155 for _, rates in sched for r in rates.values())
    assert len(sched[2][1]) == 2 * len(EDGES)


@pytest.mark.parametrize("n", [5, 10, 15])
def test_scale_scenarios_load(n: int) -> None:
    s = scenario.load(f"scale-{n}")
    assert len(s.nodes) == n
    # every DC has the same capacity, so the physical limit does not change with n
    assert min_cut(s.rates()).mbit == 400.0


BASE = """
name = "t"
[[node]]
id = 1
[[node]]
id = 2
[[node]]
id = 3
"""


@pytest.mark.parametrize(
    ("links", "needle"),
    [
        ("[[link]]\na = 1\nb = 4\nrate_mbit = 10\n", r"link\[0\]\.b: unknown node 4"),
        ("[[link]]\na = 1\nb = 2\nrate_mbit = 10\n[[link]]\na = 2\nb = 1\nrate_mbit = 5\n"
         "[[link]]\na = 2\nb = 3\nrate_mbit = 5\n", r"link\[1\]: duplicate link 2-1"),
        ("[[link]]\na = 1\nb = 2\nrate_mbit = [10, 0]\n", r"link\[0\]\.rate_mbit\[1\]: must be positive"),
        ("[[link]]\na = 1\nb = 2\nrate_mbit = 10\n", r"disconnected: nodes \[3\]"),
        ("[[link]]\na = 1\nb = 2\nrate_mbit = 10\nloss_pct = 100\n", r"loss_pct"),
        ("[[link]]\na = 1\nb = 2\nrate = 10\n", r"unknown key 'rate'"),
        ("[[link]]\na = 1\nb = 1\nrate_mbit = 10\n", r"itself"),
    ],
)
def test_bad_files_are_rejected_with_file_and_key(tmp_path, links: str, needle: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(BASE + links)
    with pytest.raises(ScenarioError, match=needle) as info:
        scenario.load(f)
    assert str(f) in str(info.value)


def test_toml_syntax_error_names_file_and_line(tmp_path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text('name = "x"\n[[node]\n')
    with pytest.raises(ScenarioError, match=r"broken\.toml.*line 2"):
        scenario.load(f)


def test_unknown_name_lists_known() -> None:
    with pytest.raises(ScenarioError, match="internet2-9"):
        scenario.load("nope-42")


def test_generated_rates_table(tmp_path) -> None:
    f = tmp_path / "g.toml"
    f.write_text(BASE + "[rates]\nseed = 1\nrange_mbit = [20, 155]\n"
                 "[[link]]\na = 1\nb = 2\n[[link]]\na = 2\nb = 3\n")
    s = scenario.load(f)
    assert s.rates() == scenario.seeded_rates([(1, 2), (2, 3)], 1, 20, 155)
