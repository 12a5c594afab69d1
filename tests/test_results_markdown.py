"""``results/README.md`` is generated from the result files beside it, so it cannot go stale."""

from __future__ import annotations

import json
from pathlib import Path

from netstorm.cli import main
from netstorm.emulation import markdown

RESULTS = Path(__file__).parent.parent / "results"


def test_committed_results_readme_is_what_the_results_give() -> None:
    assert (RESULTS / "README.md").read_text() == markdown.results_readme(RESULTS), (
        "results/README.md differs from the results: run netstorm report --markdown results")


def test_the_reproduce_report_is_what_its_results_give(tmp_path: Path) -> None:
    from netstorm.commands.reproduce import write_report
    from netstorm.emulation import figures

    folder = RESULTS / "reproduce"
    profiles = {json.loads(p.read_text()).get("reproduce", {}).get("profile") for p in folder.glob("*.json")}
    assert len(profiles) == 1
    profile = figures.PROFILES[profiles.pop()]
    for path in folder.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    # The charts' drawing is tested in test_reproduce.py; here only the text is compared.
    assert write_report(profile, tmp_path, draw=False).read_text() == (folder / "README.md").read_text()


def test_markdown_mode_writes_and_checks_a_directory(tmp_path: Path, capsys) -> None:
    source = json.loads((RESULTS / "scale-5-overlap-c9.json").read_text())
    (tmp_path / "run-a.json").write_text(json.dumps({**source, "command": "netstorm emulate scale-5 --out x"}))
    (tmp_path / "notes.json").write_text('{"not": "a result"}')
    (tmp_path / "run-a-iterations.png").write_bytes(b"png")
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 1
    assert main(["report", "--markdown", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "netstorm emulate scale-5 --out x" in text and "rebuilt from the result's fields" not in text
    assert "[run-a-iterations.png](run-a-iterations.png)" in text and "run-a-rates.png" not in text
    assert "- [`notes.json`](notes.json)" in text
    assert "| `netstorm` | 9.48 |" in text
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 0
    # A changed result makes the committed markdown stale, and --check says so.
    source["systems"]["netstorm"]["iteration_s"] = [9.0, 1.0, 1.0]
    (tmp_path / "run-a.json").write_text(json.dumps(source))
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 1


def test_a_committed_spread_sweep_is_drawn_as_a_table(tmp_path: Path) -> None:
    row = {"dc": 4, "spread_drawn": 0.446, "aleph_s": 1.5, "flat_s": 3.0, "gloo_s": 2.0,
           "runs": {"aleph": [1.0, 2.0], "flat": [3.0, 3.0], "gloo": [2.0, 2.0]},
           "less_time_than_flat": 0.5, "less_time_than_gloo": 0.25,
           "less_time_than_flat_range": [1 / 3, 2 / 3], "less_time_than_gloo_range": [0.0, 0.5]}
    sweep = {"planner": "aleph", "target": 0.2, "rows": [row], "onset": 0.446, "beats_gloo_from": 0.446}
    (tmp_path / "s-sweep.json").write_text(json.dumps({"summary_command": "python -m x --sweep", "sweep": sweep}))
    (tmp_path / "notes.json").write_text('{"sweep": "not one"}')
    text = markdown.results_readme(tmp_path)
    assert "### s-sweep.json: aleph by worker bandwidth spread" in text and "`python -m x --sweep`" in text
    assert ("| 4 | 0.45 | 2/2/2 | 3.00 | 1.50 (1.00-2.00) | 2.00 | +50 % (+33 % to +67 %) | "
            "+25 % (+0 % to +50 %) |") in text
    assert "from a drawn spread of 0.45 on, and less than gloo at all from a drawn spread of 0.45 on" in text
    assert "notes.json:" not in text
