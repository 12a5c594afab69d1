"""Runs that repeat one experiment, folded into one result file: the first run stays the document's
body (so every reader of a result reads it unchanged), the others sit under ``folded`` with the spread
of their headline figures. ``netstorm report --fold OUT RUN...`` makes one; ``--csv`` flattens any."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from netstorm.emulation import results

UNRECORDED = ("measured before results recorded their commit, package versions and the host's load; "
              "the fields are what the run recorded then")
"""The ``provenance.note`` of a folded run that predates ``netstorm.provenance``."""


def is_emulation(doc: dict[str, Any]) -> bool:
    return doc.get("format") == results.FORMAT_VERSION and isinstance(doc.get("systems"), dict)


def headline(doc: dict[str, Any]) -> dict[str, float]:
    """The figures whose spread a fold records: per system its mean iteration time and ratio to the limit
    (an emulation result), else every float one or two levels deep (a benchmark's per-path figures)."""
    if is_emulation(doc):
        return {f"{name}.{key}": value for name, st in results.system_stats(doc).items()
                for key, value in (("mean_s", st["mean_s"]), ("x_limit", st["x_limit"]))}
    out: dict[str, float] = {}
    for key, value in doc.items():
        if isinstance(value, float):
            out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if isinstance(v, float)})
    return out


def spread(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per headline figure that every run has: each run's value, min, median, max and (max-min)/median."""
    figures = [headline(r) for r in runs]
    keys = [k for k in figures[0] if all(k in f for f in figures[1:])]
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = [f[key] for f in figures]
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            continue
        med = statistics.median(finite)
        out[key] = {"runs": [round(v, 6) if math.isfinite(v) else None for v in values], "min": min(finite),
                    "median": med, "max": max(finite),
                    "spread": (max(finite) - min(finite)) / med if med else None}
    return out


def fold(runs: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """One document for ``runs`` of one experiment (named ``sources``), the first as its body."""
    if len(runs) < 2 or len(runs) != len(sources):
        raise ValueError("fold needs two or more runs, each with its source name")
    first, rest = runs[0], runs[1:]
    if any("folded" in r for r in runs):
        raise ValueError("a run is already a fold")
    body = {k: v for k, v in first.items()}
    if "provenance" not in body:
        body["provenance"] = {"recorded": False, "note": UNRECORDED}
    body["folded"] = {"count": len(runs), "sources": list(sources),
                       "runs": [r if "provenance" in r else {**r, "provenance": {"recorded": False,
                                                                                "note": UNRECORDED}}
                                for r in rest],
                       "spread": spread(runs)}
    return body


def runs_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run a result holds: itself, or its body and its repeats."""
    if "folded" not in doc:
        return [doc]
    body = {k: v for k, v in doc.items() if k != "folded"}
    return [body, *doc["folded"]["runs"]]


def fold_files(out: Path, paths: Sequence[Path]) -> dict[str, Any]:
    docs = [json.loads(p.read_text()) for p in paths]
    doc = fold(docs, [p.name for p in paths])
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


CSV_FIELDS = ("file", "run", "system", "iteration", "iteration_s", "limit_s", "sync_s", "exact", "cpu_mean_pct",
              "steal_pct", "commit")


def csv_rows(name: str, doc: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """One row per run, system and iteration of an emulation result (a benchmark: one per run and path,
    its float figures as columns)."""
    for i, run in enumerate(runs_of(doc), 1):
        commit = (run.get("provenance") or {}).get("commit") or ""
        if not is_emulation(run):
            for key, value in run.items():
                if isinstance(value, dict) and any(isinstance(v, float) for v in value.values()):
                    yield {"file": name, "run": i, "system": key, "commit": commit,
                           **{k: v for k, v in value.items() if isinstance(v, (float, int, bool))}}
            continue
        for system, s in run["systems"].items():
            limits = s.get("limit_s") or []
            sync = s.get("sync_s") or []
            cpu = s.get("cpu", {})
            for k, t in enumerate(s.get("iteration_s", [])):
                yield {"file": name, "run": i, "system": system, "iteration": k + 1, "iteration_s": t,
                       "limit_s": limits[k] if k < len(limits) else "", "sync_s": sync[k] if k < len(sync) else "",
                       "exact": s.get("exact"), "cpu_mean_pct": cpu.get("mean_pct", ""),
                       "steal_pct": cpu.get("steal_pct", ""), "commit": commit}


def write_csv(out: IO[str], docs: Sequence[tuple[str, dict[str, Any]]]) -> int:
    """Write every row of ``docs`` as CSV (the columns of all rows, the emulation ones first); rows written."""
    rows = [row for name, doc in docs for row in csv_rows(name, doc)]
    fields = list(CSV_FIELDS) + sorted({k for row in rows for k in row} - set(CSV_FIELDS))
    writer = csv.DictWriter(out, fieldnames=fields, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return len(rows)


def spread_lines(doc: dict[str, Any]) -> list[str]:
    """The terminal's lines for a fold: each system's mean iteration time over the runs."""
    if "folded" not in doc or not is_emulation(doc):
        return []
    table = spread_table(doc)
    return ["", f"repeats: {doc['folded']['count']} runs of this experiment (the table is run 1)",
            *[f"  {row[0]:<14} {row[1]:<40} {row[2]}" for row in table]]


def spread_table(doc: dict[str, Any]) -> list[list[str]]:
    """Rows (system, every run's mean iteration time, min-max and spread) of a folded emulation result."""
    rows = []
    for key, s in doc["folded"]["spread"].items():
        system, _, figure = key.rpartition(".")
        if figure != "mean_s":
            continue
        runs = " / ".join("-" if v is None else f"{v:.2f}" for v in s["runs"])
        rows.append([system, runs, f"{s['min']:.2f}-{s['max']:.2f} s ({100 * (s['spread'] or 0):.0f} %)"])
    return rows
