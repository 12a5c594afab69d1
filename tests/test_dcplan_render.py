"""``bench dc-plan``'s markdown says what its JSON holds: the integer-rate variant's best speed-up and how
both models fared at the largest instances, and where the emulated runs are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from netstorm.bench import dcplan


def _run(milp: float | None, status: str, milp_s: float, iqcp: float | None, iqcp_status: str,
         iqcp_s: float) -> dict[str, Any]:
    return {"milp": milp, "milp_status": status, "milp_s": milp_s, "milp_gap": 0.0, "iqcp": iqcp,
            "iqcp_status": iqcp_status, "iqcp_s": iqcp_s, "heuristic": 10.0, "heuristic_s": 0.01, "atp": 10.0,
            "grid": 5.0, "grid_min": 4.0, "grid_max": 6.0, "bound": 10.0}


def _study(tmp_path: Path) -> None:
    small = [_run(10.0, "optimal", 8.0, 9.0, "optimal", 0.5), _run(10.0, "optimal", 1.0, 10.0, "optimal", 2.0)]
    big = [_run(10.0, "optimal", 3.0, None, "time limit", 7.0)]
    rows = [{"point": "small", "params": {"aggregators": 12}, "runs": small},
            {"point": "big", "params": {"aggregators": 50}, "runs": big}]
    body = {"study": "eina", "command": "netstorm bench dc-plan --study eina", "wall_s": 1.0, "solver": "HiGHS",
            "time_limit_s": 7.0, "seeds": 2, "sweeps": [{"sweep": "s", "what": "", "rows": rows}]}
    (tmp_path / "dc-planners-eina.json").write_text(json.dumps(body))


def test_the_integer_variant_is_reported_at_its_best_and_at_the_largest_instances(tmp_path: Path) -> None:
    _study(tmp_path)
    md = dcplan.render(tmp_path)
    assert "up to 16.00x faster (one 12-aggregator instance; median 8.25x over 2 instances of 12 aggregators)" in md
    assert ("at 50 aggregators, big: MILP optimal in 3.0 s, integer time limit at 7.0 s, no solution: the integer "
            "model solved faster on 0 of 1") in md
    assert "No emulated run of a planned tier is in this directory." in md


def test_the_markdown_points_to_the_emulated_runs_it_finds(tmp_path: Path) -> None:
    _study(tmp_path)
    for name in ("lan-planned-dc1-eina.json", "lan-planned-dc1-atp.json", "dc-runtime-shaped-x-eina.json"):
        (tmp_path / name).write_text("{}")
    md = dcplan.render(tmp_path)
    assert "`lan-planned-*.json` (2 files)" in md and "`dc-runtime-shaped-*.json` (1 file)" in md
    assert "No emulated run" not in md
