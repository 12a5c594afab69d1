"""Compression rows of ``netstorm emulate --compression none,fediac,topk,fp16``: names, per-iteration WAN
bytes from the trainers' lines, the link counters' check, and the latency the extra rounds would add.

Each NetStorm system runs once per compression on the same network; the row is named ``netstorm`` for
none and ``netstorm+fediac`` etc. otherwise. An entry may set the method's options for its row alone,
``fediac:gia_reuse=4`` (``METHOD:NAME=VALUE:...``, NAME one of ``fediac_``'s k, bits, votes, gia_reuse),
so one run compares FediAC with and without an option on the same network; the row is named for the
entry (``netstorm+fediac:gia_reuse=4``) and its trainers get the entry's flags after the run's.

Latency is not emulated on this host (no netem), so a vote round costs next to nothing here;
``added_latency_s`` is what each extra round per iteration would add at
the scenario's link latencies on the trees planned at its initial rates: one trip up and down the
deepest tree, a hop's latency per edge (the shortest path's when an edge is not a direct link).
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from netstorm.compression.options import METHODS, CompressionOptions
from netstorm.emulation.errors import EmulationError
from netstorm.errors import ConfigError
from netstorm.scenario import Scenario

ROW_OPTIONS = {"k": float, "bits": int, "votes": int, "gia_reuse": int}
"""What a ``--compression`` entry may set for its row: the ``fediac_<name>`` options."""


def parse(text: str | None) -> list[str]:
    """``"none,fediac,fediac:gia_reuse=4"`` -> the entries in that order (default: none only)."""
    names = [n.strip().lower() for n in (text or "none").split(",") if n.strip()]
    unknown = [n for n in names if method_of(n) not in METHODS]
    if unknown or not names:
        raise EmulationError(f"unknown compression(s) {unknown or text!r}; known: {', '.join(METHODS)}")
    for name in names:
        row_options(name)
    return list(dict.fromkeys(names))


def method_of(entry: str) -> str:
    """The method of a ``--compression`` entry (what the nodes are told)."""
    return entry.split(":")[0]


def row_options(entry: str) -> dict[str, float | int]:
    """The options an entry sets for its row, validated as the trainers will take them."""
    out: dict[str, float | int] = {}
    for item in entry.split(":")[1:]:
        name, _, value = item.partition("=")
        if name not in ROW_OPTIONS or not value:
            raise EmulationError(f"compression {entry!r}: {item!r} is not NAME=VALUE with NAME one of "
                                 f"{', '.join(ROW_OPTIONS)}")
        try:
            out[name] = ROW_OPTIONS[name](value)
        except ValueError:
            raise EmulationError(f"compression {entry!r}: {name} takes a number, not {value!r}") from None
    try:
        CompressionOptions(method_of(entry), **out)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise EmulationError(f"compression {entry!r}: {exc}") from None
    return out


def row_flags(entry: str) -> list[str]:
    """The trainer flags of an entry's options (``--fediac-gia-reuse 4``)."""
    return [flag for name, value in row_options(entry).items()
            for flag in ("--fediac-" + name.replace("_", "-"), str(value))]


def row_name(system: str, compression: str) -> str:
    return system if compression == "none" else f"{system}+{compression}"


def collect(records: Mapping[str, Sequence[Mapping[str, Any]]], iterations: int) -> dict[str, Any]:
    """Per iteration, from every DC's trainer lines: WAN bytes (summed), round trips (the most any DC
    ran), the GIA size, and whether every DC decoded the same sum (same GIA size and error)."""
    wan: list[int] = []
    trips: list[int] = []
    vote_s: list[float] = []
    cumulative: list[float] = []
    gia: list[int] = []
    errors: list[float] = []
    agree = True
    for k in range(iterations):
        rows = [r for recs in records.values() for r in recs if r.get("iteration") == k]
        if not rows:
            break
        wan.append(sum(int(r.get("wan_bytes", 0)) for r in rows))
        trips.append(max(int(r.get("round_trips", 1)) for r in rows))
        gia.append(max(int(r.get("gia", 0)) for r in rows))
        rounds = [r["round_s"] for r in rows if len(r.get("round_s", ())) == 2]
        if rounds:  # the vote round's push_pull, the slowest DC's
            vote_s.append(round(max(float(s[0]) for s in rounds), 4))
        if any("rel_error" in r for r in rows):
            seen = {(r.get("gia"), r.get("rel_error")) for r in rows}
            agree &= len(seen) == 1
            errors.append(float(rows[0].get("rel_error", float("nan"))))
            if "cum_rel_error" in rows[0]:
                cumulative.append(float(rows[0]["cum_rel_error"]))
    out: dict[str, Any] = {"wan_bytes": wan, "round_trips": trips, "wan_bytes_total": sum(wan)}
    if any(gia):
        out["gia"] = gia
    if vote_s:
        out["vote_round_s"] = vote_s
    if errors:
        out["rel_error"] = [round(e, 6) for e in errors]
        if cumulative:
            out["cum_rel_error"] = [round(e, 6) for e in cumulative]
        out["dcs_agree"] = agree
    return out


def _latencies(scenario: Scenario) -> dict[int, dict[int, float]]:
    """Shortest-path one-way latency in seconds between every pair of DCs."""
    graph: dict[int, list[tuple[int, float]]] = {n: [] for n in scenario.node_ids}
    for link in scenario.links:
        graph[link.a].append((link.b, link.latency_ms / 1000.0))
        graph[link.b].append((link.a, link.latency_ms / 1000.0))
    out: dict[int, dict[int, float]] = {}
    for source in graph:
        best = {source: 0.0}
        queue = [(0.0, source)]
        while queue:
            d, node = heapq.heappop(queue)
            if d > best.get(node, float("inf")):
                continue
            for nxt, w in graph[node]:
                if d + w < best.get(nxt, float("inf")):
                    best[nxt] = d + w
                    heapq.heappush(queue, (d + w, nxt))
        out[source] = best
    return out


def tree_round_trip_s(trees: Mapping[str, Mapping[str, int | None]], scenario: Scenario) -> float:
    """Up the deepest tree and back down: twice the largest leaf-to-root latency over the trees."""
    latency = _latencies(scenario)
    worst = 0.0
    for tree in trees.values():
        for child in tree:
            node, total = int(child), 0.0
            while (parent := tree.get(str(node))) is not None:
                total += latency[node][int(parent)]
                node = int(parent)
            worst = max(worst, total)
    return 2 * worst


def latency_note(stats: dict[str, Any], trees: Mapping[str, Mapping[str, int | None]],
                 scenario: Scenario) -> dict[str, float]:
    """Round trips per iteration and what the ones beyond the first would add at the scenario's latency."""
    trips = stats["round_trips"][1:] or stats["round_trips"]  # the first may be a dense round
    mean_trips = statistics.fmean(trips) if trips else 1.0
    round_trip = tree_round_trip_s(trees, scenario)
    return {"round_trips_per_iteration": round(mean_trips, 3), "tree_round_trip_s": round(round_trip, 4),
            "added_latency_s": round((mean_trips - 1) * round_trip, 4)}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """WAN bytes per iteration against the uncompressed row of the same system, and the latency note."""
    lines: list[str] = []
    rows = {name: s for name, s in result["systems"].items() if "wan_bytes" in s}
    if not rows:
        return lines
    wide = max([22, *(len(name) + 2 for name in rows)])
    header = f"{'system':<{wide}}{'WAN MB/it':>10}{'vs none':>9}{'iter s':>9}{'vote s':>8}{'trips':>7}" \
             f"{'+latency s':>11}{'link/node':>10}{'cum err':>9}"
    lines += ["", header, "-" * len(header)]
    for name, s in rows.items():
        base = rows.get(name.split("+")[0])
        per_it = _mean_after_first(s["wan_bytes"])
        ratio = per_it / _mean_after_first(base["wan_bytes"]) if base and base is not s and base["wan_bytes"] else 1.0
        times = s.get("iteration_s", [])
        mean_s = statistics.fmean(times[1:]) if len(times) > 1 else float("nan")
        link = s.get("link_over_node_bytes")
        link = float("nan") if link is None else link   # None: a run that completed no iteration
        trips, added = s.get("round_trips_per_iteration", 1), s.get("added_latency_s", 0.0)
        vote = _mean_after_first(s["vote_round_s"]) if s.get("vote_round_s") else float("nan")
        cum = s["cum_rel_error"][-1] if s.get("cum_rel_error") else float("nan")
        lines.append(f"{name:<{wide}}{per_it / 1e6:>10.3f}{ratio:>9.2f}{mean_s:>9.2f}{vote:>8.2f}{trips:>7.2f}"
                     f"{added:>11.3f}{link:>10.3f}{cum:>9.3f}")
    lines.append("WAN MB/it: chunk frames the nodes queued on WAN links (headers included), mean over iterations "
                 "2..N; vote s: the vote round's time (slowest DC); link/node: the emulated links' tx bytes over "
                 "the nodes' count (TCP/IP headers, ACKs, multi-hop routes); +latency: what the rounds beyond "
                 "one would add at the scenario's latency; cum err: ||sum of decoded - sum of exact|| / ||sum of "
                 "exact|| after the last iteration (what error feedback still holds back)")
    return lines + accuracy_lines(result)


BYTES_TARGET = 0.60
"""FediAC's WAN bytes per iteration over dense's that the target allows."""
ACCURACY_POINTS = 2.0
"""How far (percentage points) a compressed row's final accuracy may end below dense's."""


def _reach(accuracy: Sequence[float | None], goal: float) -> int | None:
    """Iterations (1-based count) until held-out accuracy first reaches ``goal``."""
    for k, value in enumerate(accuracy):
        if value is not None and value >= goal:
            return k + 1
    return None


def accuracy_lines(result: dict[str, Any]) -> list[str]:
    """For rows that trained a real model: against the uncompressed row of the same system, final accuracy,
    WAN bytes per iteration, and the bytes and training time each needs to reach dense's final accuracy
    (as the FediAC paper reports it), with what the rounds beyond one would add by then at the scenario's
    latency."""
    rows = {name: s for name, s in result["systems"].items() if "wan_bytes" in s and s.get("accuracy")}
    wide = max([22, *(len(name) + 2 for name in rows)])
    lines: list[str] = []
    for name, s in rows.items():
        base = rows.get(name.split("+")[0])
        if base is None:
            continue
        if not lines:
            header = (f"{'system':<{wide}}{'final acc':>10}{'vs dense':>9}{'B/it vs':>8}{'to dense final':>15}"
                      f"{'MB to it':>10}{'s to it':>9}{'+lat s':>8}")
            lines += ["", header, "-" * len(header)]
        goal = [a for a in base["accuracy"] if a is not None][-1]
        final = [a for a in s["accuracy"] if a is not None][-1]
        ratio = _mean_after_first(s["wan_bytes"]) / _mean_after_first(base["wan_bytes"])
        reached = _reach(s["accuracy"], goal)
        head = f"{name:<{wide}}{final:>10.3f}{100 * (final - goal):>+9.1f}{ratio:>8.2f}"
        if reached is None:
            lines.append(f"{head}{'not reached':>15}{'-':>10}{'-':>9}{'-':>8}")
            continue
        mbytes = sum(s["wan_bytes"][:reached]) / 1e6
        seconds = sum(s["iteration_s"][:reached])
        added = float(s.get("added_latency_s", 0.0)) * reached
        lines.append(f"{head}{f'it {reached}':>15}{mbytes:>10.1f}{seconds:>9.1f}{added:>8.1f}")
    if lines:
        lines.append(f"final acc: held-out accuracy after the last iteration; vs dense: points against the "
                     f"uncompressed row; B/it vs: WAN bytes per iteration over dense's (the target for fediac: "
                     f"<= {BYTES_TARGET:.2f}, and a final accuracy within {ACCURACY_POINTS:g} points); to dense "
                     f"final: the first iteration at dense's final accuracy, with the WAN MB and the training "
                     f"seconds until then; +lat s: what the rounds beyond one per iteration would add by then at "
                     f"the scenario's latency (not emulated here)")
    return lines


def _mean_after_first(values: Sequence[float]) -> float:
    rest = list(values[1:]) or list(values)
    return statistics.fmean(rest) if rest else float("nan")
