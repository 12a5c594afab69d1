"""``results/`` stays curated: few files, each one a claim or a figure the documents cite, repeats of one
experiment folded into one file, and every result traceable to the code that made it."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from netstorm.cli import main
from netstorm.emulation import repeats
from netstorm.provenance import provenance, write_result

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "results"
MAX_FILES = 60
HAND_WRITTEN = (ROOT / "README.md", ROOT / "docs" / "ARCHITECTURE.md", RESULTS / "DECISIONS.md")
"""The documents that make claims; a result they do not name is not a result anyone relies on."""
GENERATED = (RESULTS / "README.md", RESULTS / "reproduce" / "README.md", RESULTS / "dc-planners.md")
"""Generated from the JSON; they may cite figures (plots) of the results they render."""


def _files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and ".partial" not in p.parts)


def _names(name: str, text: str) -> bool:
    return bool(name) and re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None


def test_results_holds_at_most_sixty_files() -> None:
    files = _files()
    assert len(files) <= MAX_FILES, f"results/ holds {len(files)} files (at most {MAX_FILES}): fold repeats " \
                                    "(netstorm report --fold) or move history to results/DECISIONS.md"


def test_every_result_file_is_cited_by_the_documents() -> None:
    hand = "\n".join(p.read_text() for p in HAND_WRITTEN)
    generated = "\n".join(p.read_text() for p in GENERATED)
    uncited = []
    for path in _files():
        rel = path.relative_to(RESULTS).as_posix()
        if path in HAND_WRITTEN or path in GENERATED[:1]:
            continue
        text = hand + generated if path.suffix == ".png" else hand
        own = (path.parent / "README.md").read_text() if path.suffix == ".png" and path.parent != RESULTS else ""
        if not (_names(rel, text) or _names(path.name, own)):
            uncited.append(rel)
    assert not uncited, f"result files no document cites: {uncited}"


def test_every_committed_result_records_its_provenance_or_says_it_predates_it() -> None:
    for path in RESULTS.rglob("*.json"):
        doc = json.loads(path.read_text())
        runs = list(doc["runs"].values()) if path.name == "runs.json" else repeats.runs_of(doc)
        for run in runs:
            record = run.get("provenance")
            assert record is not None, path
            if record["recorded"]:
                assert re.fullmatch(r"[0-9a-f]{40}", record["commit"] or ""), path
                assert record["versions"]["netstorm"] and record["host"]["load_average"], path
            else:
                assert record["note"] == repeats.UNRECORDED, path


def test_a_written_result_records_commit_versions_and_load(tmp_path: Path) -> None:
    doc = write_result(tmp_path / "r.json", {"x": 1.0})
    assert json.loads((tmp_path / "r.json").read_text()) == doc
    record = doc["provenance"]
    assert record["recorded"] and re.fullmatch(r"[0-9a-f]{40}", record["commit"])
    assert set(record["versions"]) >= {"python", "netstorm", "numpy", "msgspec"}
    assert len(record["host"]["load_average"]) == 3 and record["host"]["cpus"] >= 1
    assert write_result(tmp_path / "s.json", doc)["provenance"] == record   # kept, not re-stamped
    assert provenance()["commit"] == record["commit"]


def _emulation(times: list[float]) -> dict:
    source = json.loads((RESULTS / "scale-5-overlap-c9.json").read_text())
    source.pop("provenance")
    source["systems"]["netstorm"]["iteration_s"] = times
    source["systems"]["netstorm"]["limit_s"] = [1.0] * len(times)
    source["systems"]["netstorm"]["limit_errors"] = []
    return source


def test_fold_keeps_the_first_run_as_the_body_and_the_spread_of_all(tmp_path: Path) -> None:
    runs = [_emulation([20.0, 12.0, 12.0]), _emulation([20.0, 13.0, 13.0]), _emulation([20.0, 14.0, 14.0])]
    for i, run in enumerate(runs):
        (tmp_path / f"x-run{i + 1}.json").write_text(json.dumps(run))
    names = [str(tmp_path / f"x-run{i + 1}.json") for i in range(3)]
    assert main(["report", *names, "--fold", str(tmp_path / "x.json")]) == 0
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["systems"] == runs[0]["systems"] and doc["folded"]["count"] == 3
    assert doc["folded"]["sources"] == ["x-run1.json", "x-run2.json", "x-run3.json"]
    s = doc["folded"]["spread"]["netstorm.mean_s"]
    assert s["runs"] == [12.0, 13.0, 14.0] and (s["min"], s["median"], s["max"]) == (12.0, 13.0, 14.0)
    assert s["spread"] == pytest.approx(2.0 / 13.0)
    assert doc["provenance"] == {"recorded": False, "note": repeats.UNRECORDED}
    assert [r["systems"]["netstorm"]["iteration_s"] for r in repeats.runs_of(doc)] == [
        [20.0, 12.0, 12.0], [20.0, 13.0, 13.0], [20.0, 14.0, 14.0]]
    assert main(["report", str(tmp_path / "x.json"), str(tmp_path / "x-run1.json"), "--fold",
                 str(tmp_path / "y.json")]) == 1   # a fold is not folded again


def test_csv_has_one_row_per_run_system_and_iteration(tmp_path: Path) -> None:
    doc = repeats.fold([_emulation([9.0, 2.0, 2.0]), _emulation([9.0, 3.0])], ["a.json", "b.json"])
    (tmp_path / "x.json").write_text(json.dumps(doc))
    assert main(["report", str(tmp_path / "x.json"), "--csv", str(tmp_path / "x.csv")]) == 0
    rows = list(csv.DictReader(io.StringIO((tmp_path / "x.csv").read_text())))
    assert [(r["run"], r["system"], r["iteration"], r["iteration_s"]) for r in rows] == [
        ("1", "netstorm", "1", "9.0"), ("1", "netstorm", "2", "2.0"), ("1", "netstorm", "3", "2.0"),
        ("2", "netstorm", "1", "9.0"), ("2", "netstorm", "2", "3.0")]
    assert all(r["limit_s"] == "1.0" and r["file"] == "x.json" for r in rows)


def test_csv_of_a_committed_benchmark_has_a_row_per_run_and_path(capsys) -> None:
    assert main(["report", str(RESULTS / "edge-4w-loss0-mtu3272-kernel.json"), "--csv", "-"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {(r["run"], r["system"]) for r in rows} == {(str(i), p) for i in (1, 2, 3)
                                                      for p in ("xdp", "userspace", "gloo")}
    assert all(float(r["wall_gbit"]) > 0 for r in rows)
