"""The chaos spec of ``netstorm emulate --chaos``: what it schedules and what it refuses, by name."""

from __future__ import annotations

import pytest

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
