"""``netstorm bench policy`` runs end to end and agrees with its networkx reference on the path count."""

from __future__ import annotations

from netstorm.cli import main


def test_bench_policy_small(capsys):
    assert main(["bench", "policy", "--sizes", "12", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out  # the plain networkx Algorithm 3 found as many paths as the planner
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("12", "20")]
    assert [row[0] for row in rows] == ["12", "20"]
    assert all(float(row[4]) > 0 for row in rows)
