"""Fold the DiLoCo trainers' JSON lines (``diloco_run``'s schema) into one system's result entry.

Plain data in, plain data out: per DC its records (``start``, ``sync``, ``eval``, ``end``; a restarted
trainer appends a second ``start``), the run's link rate log and the wall-clock time its zero is at. A
sync's limit is its fragment's bytes over λ of the rates in force from when it began
(``results.window_limit_s``, as for the synthetic trainer's iterations). The run's ``target_loss`` is
``TARGET_FACTOR`` times the reference's final held-out loss; a system's time to it is the trainers' wall
time (evaluation excluded) at its first evaluation at or below it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from netstorm.emulation import results

TARGET_FACTOR = 1.05
TARGET_FROM = ("netstorm-ddp", "gloo-ddp")
"""Whose final evaluation sets ``target_loss``: the first of these the run has."""
TARGET_RULE = f"{TARGET_FACTOR} x the final eval loss of the first of {', '.join(TARGET_FROM)} that ran"

Records = Sequence[Mapping[str, Any]]


def _kind(records: Records, kind: str) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == kind]


def curve_dc(per_dc: Mapping[int, Records]) -> int:
    """The DC whose evaluations stand for the system: every DC evaluates the same global parameters, so
    the one with the most evaluations (a DC that was down has fewer), the lowest id on a tie."""
    return min(per_dc, key=lambda dc: (-len(_kind(per_dc[dc], "eval")), dc))


def syncs(per_dc: Mapping[int, Records]) -> dict[int, list[Mapping[str, Any]]]:
    """Per sync index, every DC's record of it (a DC down during it has none)."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for records in per_dc.values():
        for r in _kind(records, "sync"):
            out.setdefault(int(r["index"]), []).append(r)
    return dict(sorted(out.items()))


def identical(per_dc: Mapping[int, Records]) -> bool:
    """Every sync's DCs started it from one digest (the state after the outer step before it) and every DC
    that finished ended with one digest. No syncs or no ends is not agreement."""
    by_index = syncs(per_dc)
    ends = {r["digest"] for records in per_dc.values() for r in _kind(records, "end")}
    return bool(by_index) and len(ends) == 1 and all(len({r["digest"] for r in rs}) == 1 for rs in by_index.values())


def fragment_bytes(per_dc: Mapping[int, Records], fragments: int = 1) -> int:
    """A fragment's bytes on the wire as the trainers said (``start``), else float32 values of
    ``parameters`` over ``fragments`` (a trainer that does not say)."""
    starts = [r for records in per_dc.values() for r in _kind(records, "start")]
    said = [int(r["fragment_bytes"]) for r in starts if r.get("fragment_bytes") is not None]
    if said:
        return max(said)
    return 4 * -(-max(int(r["parameters"]) for r in starts) // fragments)


def began(rs: Sequence[Mapping[str, Any]], origin: float) -> float:
    """When a sync's earliest DC began it, in rate-log seconds; a trainer that stamps no ``began`` is
    bounded from the log's start (the rates of the schedule's first epoch)."""
    stamps = [float(r["began"]) for r in rs if r.get("began") is not None]
    return min(stamps) - origin if stamps else 0.0


def sync_limits(per_dc: Mapping[int, Records], rate_log: list[dict[str, Any]], origin: float,
                fragments: int = 1) -> list[float]:
    """Per sync, its fragment's bytes over λ of the rates in force from its earliest DC's start on
    (``origin``: the wall-clock time of the rate log's zero)."""
    size = fragment_bytes(per_dc, fragments)
    starts = [r for records in per_dc.values() for r in _kind(records, "start")]
    # a trainer whose fragments differ in size (torchft's whole tensors) names each one's elements
    elements = next((list(r["fragment_elements"]) for r in starts if r.get("fragment_elements")), None)
    return [round(results.window_limit_s(4 * int(elements[int(rs[0].get("fragment", 0))]) if elements else size,
                                         rate_log, began(rs, origin)), 4) for rs in syncs(per_dc).values()]


def rejoined(per_dc: Mapping[int, Records], restarts: Sequence[tuple[int, float]]) -> dict[str, int | None]:
    """Per restarted DC (``restarts``: (dc, wall time of the restart)), the job's syncs begun from the restart
    on, up to and including the first whose digest the DC shares with every other DC that ran it (None:
    never)."""
    out: dict[str, int | None] = {}
    for dc, at in restarts:
        after = [(i, rs) for i, rs in syncs(per_dc).items() if began(rs, 0.0) >= at]
        out[str(dc)] = None
        for k, (i, rs) in enumerate(after, 1):
            mine = [r for r in _kind(per_dc[dc], "sync") if int(r["index"]) == i]
            if mine and len({r["digest"] for r in rs}) == 1:
                out[str(dc)] = k
                break
    return out


def job_restarts(per_dc: Mapping[int, Records], restarted: Mapping[int, int]) -> int:
    """Trainer starts beyond each DC's first that no chaos restart explains (``restarted``: per DC, how
    many the chaos schedule did): a restart of the job, which DiLoCo's rejoin should make unnecessary."""
    return sum(max(0, len(_kind(records, "start")) - 1 - restarted.get(dc, 0)) for dc, records in per_dc.items())


def system_entry(per_dc: Mapping[int, Records], rate_log: list[dict[str, Any]], origin: float, *,
                 steps: int, link_bytes: int | None, fragments: int = 1) -> dict[str, Any]:
    """One system's result entry (without ``time_to_target_s``: ``with_targets`` adds it)."""
    dc = curve_dc(per_dc)
    curve = [{k: round(float(r[k]), 5) for k in ("t_s", "loss", "accuracy")} | {"step": int(r["step"])}
             for r in _kind(per_dc[dc], "eval")]
    by_index = syncs(per_dc)
    ends = [r for records in per_dc.values() for r in _kind(records, "end")]
    wall = sum(float(r["wall_s"]) for r in ends)
    node_bytes = [r["wan_bytes"] for rs in by_index.values() for r in rs]
    return {
        "eval": [{"t_s": c["t_s"], "step": c["step"], "loss": c["loss"], "accuracy": c["accuracy"]} for c in curve],
        "curve_dc": dc,
        "final_eval_loss": curve[-1]["loss"] if curve else None,
        "compute_fraction": round(sum(float(r["compute_s"]) for r in ends) / wall, 4) if wall > 0 else None,
        "sync_s": [round(max(float(r["seconds"]) for r in rs), 4) for rs in by_index.values()],
        "sync_limit_s": sync_limits(per_dc, rate_log, origin, fragments) if by_index else [],
        "fragment_bytes": fragment_bytes(per_dc, fragments) if any(_kind(r, "start") for r in per_dc.values())
        else None,
        "wan_bytes_per_step": round(link_bytes / steps) if link_bytes is not None and steps else None,
        "node_wan_bytes_per_step": round(sum(node_bytes) / steps) if node_bytes and None not in node_bytes
        and steps else None,
        "steps_completed": min((int(r["steps"]) for r in ends), default=0) if len(ends) >= len(per_dc) else
        max((int(r["steps"]) for r in ends), default=0),
        "wall_s": round(max((float(r["wall_s"]) for r in ends), default=0.0), 3),
        "identical": identical(per_dc),
    }


def time_to(curve: Sequence[Mapping[str, Any]], target: float | None) -> float | None:
    """The first evaluation's ``t_s`` whose loss is at or below ``target`` (None: none, or no target)."""
    if target is None:
        return None
    return next((float(c["t_s"]) for c in curve if float(c["loss"]) <= target), None)


def with_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Set ``target_loss`` (``TARGET_RULE``) and every system's ``time_to_target_s``; returns ``result``."""
    source = next((name for name in TARGET_FROM
                   if result["systems"].get(name, {}).get("final_eval_loss") is not None), None)
    target = round(TARGET_FACTOR * float(result["systems"][source]["final_eval_loss"]), 5) if source else None
    result["target_loss"] = target
    result["target_rule"] = TARGET_RULE
    result["target_from"] = source
    for entry in result["systems"].values():
        entry["time_to_target_s"] = time_to(entry.get("eval", []), target)
    return result


def medians(entry: Mapping[str, Any]) -> dict[str, float | None]:
    """The median sync time, sync limit and their ratio of one entry (the summary's columns)."""
    s, lim = entry.get("sync_s") or [], entry.get("sync_limit_s") or []
    ratio = [a / b for a, b in zip(s, lim, strict=False) if b > 0]
    return {"sync_s": statistics.median(s) if s else None, "sync_limit_s": statistics.median(lim) if lim else None,
            "x_limit": statistics.median(ratio) if ratio else None}


def summary(result: dict[str, Any]) -> str:
    """The terminal table: per system its final loss, time to the target, compute share and syncs."""
    lines = [f"target_loss {result.get('target_loss')} ({result.get('target_rule')})",
             f"{'system':<20}{'final loss':>11}{'to target s':>12}{'compute':>9}{'syncs':>7}{'sync s':>9}"
             f"{'limit s':>9}{'x limit':>9}{'identical':>10}"]
    for name, s in result["systems"].items():
        if s.get("error"):
            lines.append(f"{name:<20} FAILED: {s['error']}")
            continue
        m = medians(s)

        def cell(v: Any, width: int, fmt: str = ".3f") -> str:
            return f"{'-' if v is None else format(v, fmt):>{width}}"

        lines.append(f"{name:<20}{cell(s.get('final_eval_loss'), 11, '.4f')}"
                     f"{cell(s.get('time_to_target_s'), 12, '.1f')}"
                     f"{cell(s.get('compute_fraction'), 9, '.2f')}{len(s.get('sync_s', [])):>7}"
                     f"{cell(m['sync_s'], 9)}{cell(m['sync_limit_s'], 9)}{cell(m['x_limit'], 9, '.2f')}"
                     f"{s.get('identical')!s:>10}")
    lines.append("sync s, limit s, x limit: medians over the syncs (limit: a fragment's bytes over the min cut λ of "
                 "the rates in force)")
    return "\n".join(lines)
