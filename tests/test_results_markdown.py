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
    assert write_report(profile, tmp_path).read_text() == (folder / "README.md").read_text()


def test_markdown_mode_writes_and_checks_a_directory(tmp_path: Path, capsys) -> None:
    source = json.loads((RESULTS / "scale-5.json").read_text())
    (tmp_path / "run-a.json").write_text(json.dumps({**source, "command": "netstorm emulate scale-5 --out x"}))
    (tmp_path / "notes.json").write_text('{"not": "a result"}')
    (tmp_path / "run-a-iterations.png").write_bytes(b"png")
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 1
    assert main(["report", "--markdown", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "netstorm emulate scale-5 --out x" in text and "rebuilt from the result's fields" not in text
    assert "[run-a-iterations.png](run-a-iterations.png)" in text and "run-a-rates.png" not in text
    assert "- [`notes.json`](notes.json)" in text
    assert "| `netstorm` | 2.83 |" in text
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 0
    # A changed result makes the committed markdown stale, and --check says so.
    source["systems"]["netstorm"]["iteration_s"] = [9.0, 1.0, 1.0]
    (tmp_path / "run-a.json").write_text(json.dumps(source))
    assert main(["report", "--markdown", str(tmp_path), "--check"]) == 1
