"""What a chaos run did, per step and per fault, from the trainers' lines and the chaos log.

Every ``--rejoinable`` synthetic trainer writes one line per step: done (``exact``, ``workers``, the
sum of the contributing DCs' ids read from the result, ``t``) or failed. A step's contributors are the
DCs whose trainer completed it; it was exact when every one of them found its result exact and every
one saw the same count and id sum as the contributors' own (so no DC's gradient is missing from a sum
that claims it or counted in one that does not). A fault's recovery time runs from the fault to the
first exact step, completed after its repair (the restart, the link back up; the fault itself when
nothing repairs it), to which every DC of the job contributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REPAIR = {"kill-dc": "restart-dc", "kill-scheduler": "restart-scheduler", "link-down": "link-up"}


def steps(records: Mapping[int, Iterable[Mapping[str, Any]]], origin: float) -> list[dict[str, Any]]:
    """Per step: contributors, exact, the DCs whose attempt failed, when it completed (s from ``origin``)."""
    done: dict[int, dict[int, Mapping[str, Any]]] = {}
    failed: dict[int, set[int]] = {}
    for dc, lines in records.items():
        for line in lines:
            if "iteration" not in line:
                continue
            step = int(line["iteration"])
            if line.get("failed"):
                failed.setdefault(step, set()).add(dc)
            else:
                done.setdefault(step, {})[dc] = line
    out = []
    for step in sorted(set(done) | set(failed)):
        by_dc = done.get(step, {})
        dcs = sorted(by_dc)
        exact = bool(dcs) and all(
            bool(r.get("exact")) and int(r.get("workers", -1)) == len(dcs)
            and float(r.get("id_sum", -1)) == float(sum(dcs)) for r in by_dc.values())
        completed = max((float(r["t"]) for r in by_dc.values() if "t" in r), default=None)
        out.append({"step": step, "contributors": dcs, "exact": exact,
                    "failed": sorted(failed.get(step, set()) - set(dcs)),
                    "done_s": None if completed is None else round(completed - origin, 2)})
    return out


def recoveries(faults: Sequence[Mapping[str, Any]], table: list[dict[str, Any]], dcs: Iterable[int],
               origin: float) -> list[dict[str, Any]]:
    """Per fault (not repair): when it happened, its repair, the first exact step after it (any
    contributors) and the time to recover (an exact step of every DC after the repair)."""
    everyone = sorted(dcs)
    exact = [row for row in table if row["exact"] and row["done_s"] is not None]
    out = []
    for i, fault in enumerate(faults):
        if fault["action"] not in REPAIR:
            continue
        at = float(fault["t"]) - origin
        repair = next((f for f in faults[i + 1:] if f["action"] == REPAIR[fault["action"]]
                       and f["target"] == fault["target"]), None)
        repaired = float(repair["t"]) - origin if repair is not None else at
        first = next((row for row in exact if row["done_s"] > at), None)
        whole = next((row for row in exact if row["done_s"] > repaired and row["contributors"] == everyone), None)
        out.append({"fault": fault["fault"], "at_s": round(at, 2),
                    "repaired_at_s": round(repaired, 2) if repair is not None else None,
                    "first_exact_step": first["step"] if first else None,
                    "first_exact_after_s": round(first["done_s"] - at, 2) if first else None,
                    "recovered_step": whole["step"] if whole else None,
                    "recovery_s": round(whole["done_s"] - at, 2) if whole else None})
    return out


def lines(result: Mapping[str, Any]) -> list[str]:
    """The chaos tables of one system's result, for ``netstorm report``."""
    chaos = result.get("chaos")
    if not chaos:
        return []
    out = ["  step  done(s)  exact  contributors           failed"]
    for row in chaos["steps"]:
        done = "-" if row["done_s"] is None else f"{row['done_s']:.1f}"
        out.append(f"  {row['step']:4d}  {done:>7}  {'yes' if row['exact'] else 'NO':>5}  "
                   f"{','.join(map(str, row['contributors'])) or '-':<21}  {','.join(map(str, row['failed'])) or ''}")
    out.append("  fault                   at(s)  repaired(s)  first exact after(s)  recovered in(s) (step)")
    for row in chaos["recoveries"]:
        repaired = "-" if row["repaired_at_s"] is None else f"{row['repaired_at_s']:.1f}"
        first = "-" if row["first_exact_after_s"] is None else f"{row['first_exact_after_s']:.1f}"
        whole = "never" if row["recovery_s"] is None else f"{row['recovery_s']:.1f} ({row['recovered_step']})"
        out.append(f"  {row['fault']:<22}  {row['at_s']:5.1f}  {repaired:>11}  {first:>20}  {whole:>15}")
    for entry in chaos["faults"]:
        if entry.get("error"):
            out.append(f"  {entry['fault']} could not be done: {entry['error']}")
    verdict = "every completed step exact" if chaos["all_exact"] else "SOME COMPLETED STEP WAS NOT EXACT"
    out.append(f"  {len([r for r in chaos['steps'] if r['contributors']])} steps completed, {verdict}")
    return out
