"""The chaos spec of ``netstorm emulate --chaos``: what it schedules and what it refuses, by name."""

from __future__ import annotations

import pytest

from netstorm.emulation import recovery
from netstorm.emulation.chaos import Fault, parse
from netstorm.errors import ConfigError

DCS = range(1, 10)
LINKS = [(2, 5), (1, 2), (3, 4)]


def test_a_full_schedule_in_time_order() -> None:
    faults = parse("restart-dc:3@35s,kill-dc:3@20s,kill-scheduler@50,restart-scheduler@60s,"
                   "link-down:5-2@70s,link-up:2-5@80.5s", dcs=DCS, links=LINKS)
    assert faults == [Fault(20.0, "kill-dc", (3,)), Fault(35.0, "restart-dc", (3,)), Fault(50.0, "kill-scheduler"),
                      Fault(60.0, "restart-scheduler"), Fault(70.0, "link-down", (2, 5)),
                      Fault(80.5, "link-up", (2, 5))]
    assert [str(f) for f in faults[:2]] == ["kill-dc:3@20s", "restart-dc:3@35s"]
    assert [f.repairs for f in faults] == [False, True, False, True, False, True]


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty schedule"),
    ("kill-dc:3", "expected ACTION"),
    ("explode:3@5s", "unknown action 'explode'"),
    ("kill-dc:12@5s", "no DC 12"),
    ("kill-dc@5s", "needs a target"),
    ("kill-scheduler:1@5s", "takes no target"),
    ("link-down:1-9@5s", "no overlay link between DCs 1 and 9"),
    ("restart-dc:3@5s", "repairs something no earlier item broke"),
    ("kill-dc:3@5s,kill-dc:3@9s", "not repaired yet"),
    ("link-down:2-5@5s,link-up:2-5@4s", "repairs something no earlier item broke"),
])
def test_a_bad_schedule_is_refused_naming_the_item(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(spec, dcs=DCS, links=LINKS)


def line(step: int, dc: int, t: float, *, workers: int = 3, id_sum: float = 6.0, exact: bool = True,
         failed: bool = False) -> dict[str, object]:
    if failed:
        return {"iteration": step, "failed": True, "exact": False, "dc": dc, "t": t}
    return {"iteration": step, "exact": exact, "workers": workers, "id_sum": id_sum, "dc": dc, "t": t}


def test_steps_name_their_contributors_and_catch_a_sum_that_lies() -> None:
    records = {
        1: [line(0, 1, 101), line(1, 1, 103, failed=True), line(2, 1, 105, workers=2, id_sum=3),
            line(3, 1, 107, workers=3, id_sum=6)],
        2: [line(0, 2, 101), line(1, 2, 103, failed=True), line(2, 2, 105, workers=2, id_sum=3),
            line(3, 2, 107, workers=2, id_sum=3)],  # DC 2 was told a sum without DC 3
        3: [line(0, 3, 101.5), line(3, 3, 107.5)],
    }
    table = recovery.steps(records, origin=100.0)
    assert [(r["step"], r["contributors"], r["exact"], r["failed"], r["done_s"]) for r in table] == [
        (0, [1, 2, 3], True, [], 1.5), (1, [], False, [1, 2], None), (2, [1, 2], True, [], 5.0),
        (3, [1, 2, 3], False, [], 7.5)]


def test_recovery_runs_from_the_fault_to_an_exact_step_of_every_dc_after_the_repair() -> None:
    table = [{"step": 0, "contributors": [1, 2, 3], "exact": True, "failed": [], "done_s": 1.0},
             {"step": 1, "contributors": [1, 2], "exact": True, "failed": [], "done_s": 4.0},
             {"step": 2, "contributors": [1, 2], "exact": True, "failed": [], "done_s": 6.0},
             {"step": 3, "contributors": [1, 2, 3], "exact": True, "failed": [], "done_s": 9.0}]
    faults = [{"fault": "kill-dc:3@2s", "action": "kill-dc", "target": [3], "t": 102.0},
              {"fault": "restart-dc:3@5s", "action": "restart-dc", "target": [3], "t": 105.0},
              {"fault": "link-down:1-2@7s", "action": "link-down", "target": [1, 2], "t": 107.0}]
    rows = recovery.recoveries(faults, table, [1, 2, 3], origin=100.0)
    assert rows[0] == {"fault": "kill-dc:3@2s", "at_s": 2.0, "repaired_at_s": 5.0, "first_exact_step": 1,
                       "first_exact_after_s": 2.0, "recovered_step": 3, "recovery_s": 7.0}
    assert rows[1]["repaired_at_s"] is None and rows[1]["recovery_s"] == 2.0
    text = "\n".join(recovery.lines({"chaos": {"steps": table, "recoveries": rows, "faults": faults,
                                               "all_exact": True}}))
    assert "kill-dc:3@2s" in text and "every completed step exact" in text
